"""A node's loader service (`service="node"`): one process serving every rank of a job that
builds the same Loader.

A rank starts it (`rendezvous`), with the socket already listening; it serves each rank
that connects as the process service serves its one client (`server.Service`), but every
rank's passes share what the node has once: the read budget (`concurrency`), the connection
pools, the hedger and disk cache (`NodeShare.storage`), the decode processes (`num_workers`),
whose waiting chunks go earliest step first, so the rank furthest behind is served first, and
the shared-memory blocks, within `memory_limit`. Each rank's passes keep its own epoch, position
and division: a rank gets exactly the batches its own Loader would.

It admits only its own user (the peer's uid) and only the Loader it was started for (the
fingerprint); it ends when its last rank leaves, and its zygote then ends its decode processes
and removes their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import pickle
import signal
import socket
import sys
import traceback
import warnings
from pathlib import Path
from typing import TextIO

from .._blocking import off_loop
from .._config import LoaderConfig
from .._errors import LoaderError
from .._ipc import shm
from .._ipc.channel import dumps, frame, read_message
from .._ipc.messages import Chunk
from .._ipc.transport import BlockPool
from .._loopthread import new_event_loop
from .._pass import autotune
from .._pass.budget import MemoryBudget
from .._pass.factory import PassFactory
from .._processes.zygote import START_TIMEOUT, Zygote
from .._scheduling.decoders import Decoder, PoolDecoder, SharedDecoder
from .._worker.decode import one_line
from . import rendezvous
from .messages import Failed, Ready, ServiceInit
from .server import Service

REFUSAL_SECONDS = 5.0
"""How long a refused peer has to read why before its connection is closed."""


class NodeShare:
    """What every rank's passes share (`factory.Share`), built from the first rank's
    configuration in the service's event loop. `node` builds the shared parts: its decode
    pool persists."""

    def __init__(self, config: LoaderConfig, ranks: int) -> None:
        self.ranks = ranks
        self.node = node = PassFactory(dataclasses.replace(
            config, service=None, rank=0, world_size=1, persistent_workers=True,
            shared_memory=False), export=True)
        self.disk_cache = node.disk_cache
        self.counters = node.stats.storage
        self.reads = autotune.ReadLimit(config.concurrency)
        self.storage = node.new_storage(config.concurrency)
        self.blocks: BlockPool | None = None
        if config.shared_memory and shm.available():
            self.blocks = BlockPool(max_blocks=ranks * node.blocks_per_pass(),
                                    max_idle=config.memory_limit, export=True)
        self.budget = MemoryBudget(config.memory_limit, self.blocks)
        self._decoder = self._pool_decoder()

    def decoder(self) -> SharedDecoder:
        """A new pass's use of the decode processes. A decoder that failed (its processes
        did not start, or died past the budget: every pass on it failed too) is replaced; the
        restart budget starts again with each pass, as a Loader's own does."""
        if isinstance(self._decoder, PoolDecoder):
            if self._decoder.failure is not None:
                old, self._decoder = self._decoder, self._pool_decoder()
                asyncio.get_running_loop().create_task(old.aclose())
            else:
                self._decoder.recovery.restarts = 0
        return SharedDecoder(self._decoder)

    def start_decoding(self) -> None:
        """The node's decode processes, started as the first rank was admitted: wait until
        each is ready. Blocking."""
        self.node.start_decoding(0)

    def _pool_decoder(self) -> Decoder:
        decoder = self.node.decoder(0)
        if isinstance(decoder, PoolDecoder):
            decoder.on_ignored = self._drop_block
        return decoder

    def _drop_block(self, chunk: Chunk) -> None:
        """A result nobody waits for (its pass ended) came back: its block goes now, if the
        pass's end has not let go of it already."""
        if chunk.slot is not None and self.blocks is not None:
            self.blocks.retire(chunk.slot.name)

    async def aclose(self) -> None:
        try:
            await self._decoder.aclose()
            await self.storage.aclose()
        finally:
            await off_loop(self.node.close)
            if self.blocks is not None:
                self.blocks.close()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the ranks' to handle
    listening = socket.socket(fileno=int(sys.argv[1]))
    loop = new_event_loop()
    try:
        loop.run_until_complete(_Node(listening, Path(sys.argv[2])).serve())
    finally:
        loop.close()
    return 0


class _Node:
    def __init__(self, listening: socket.socket, path: Path) -> None:
        self._listening = listening
        self._path = path
        self._inode = os.stat(path).st_ino
        self._share: NodeShare | None = None
        self._fingerprint = ""
        self._setting_up = asyncio.Lock()
        self._services: dict[int, Service] = {}
        self._connections = 0
        """Ranks connected, admitted or not yet."""
        self._removed: dict[int, list[str]] = {}
        """Per rank: blocks unlinked that it has not been told of (it may map any block)."""
        self._ids = itertools.count()
        self._arrived = asyncio.Event()
        self._left = asyncio.Event()
        self._ending = False
        """Set once it stopped listening: a rank accepted just before is turned away."""

    async def serve(self) -> None:
        warnings.showwarning = self._warn
        self._listening.setblocking(False)
        server = await asyncio.start_unix_server(self._connected, sock=self._listening)
        try:
            with contextlib.suppress(asyncio.TimeoutError):  # a starter that died before connecting
                await asyncio.wait_for(self._arrived.wait(), START_TIMEOUT)
            while not await self._ended(server):
                self._left.clear()
                await self._left.wait()
        finally:
            server.close()
            if self._share is not None:
                await self._share.aclose()

    async def _ended(self, server: asyncio.AbstractServer) -> bool:
        """End once no rank is connected: stop listening, under the lock ranks start a service
        with, and remove the socket unless a new service already took its place."""
        if self._connections:
            return False
        with rendezvous.locked(self._path.with_suffix(".lock")):
            if self._connections:
                return False
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self._path).st_ino == self._inode:  # not a new service's
                    rendezvous.remove_ended(str(self._path))
            server.close()
            self._ending = True
        return True

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                         ) -> None:
        if self._ending:  # the rank sees its connection end before "ready", and looks again
            writer.close()
            return
        key = next(self._ids)
        self._connections += 1
        self._arrived.set()
        factory: PassFactory | None = None
        self._removed[key] = []
        try:
            factory = await self._admit(reader, writer)
            if factory is None:
                return
            service = self._services[key] = Service(
                factory, lambda: self._take_removed(key), own_process=False)
            await service.serve(reader, writer)
        finally:
            self._services.pop(key, None)
            self._removed.pop(key, None)
            if factory is not None:
                await off_loop(factory.close)
            writer.close()
            self._connections -= 1
            if not self._connections:
                self._left.set()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> PassFactory | None:
        """The rank's pass factory, once its peer and configuration are checked; None
        (refusal sent) otherwise."""
        factory = None
        try:
            _check_peer(writer.get_extra_info("socket"))
            init: ServiceInit = await asyncio.wait_for(read_message(reader), START_TIMEOUT)
            async with self._setting_up:
                factory = await self._rank_factory(init)
            writer.writelines(frame(dumps(Ready(os.getpid()))))
            await writer.drain()
            return factory
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass
        except Exception as e:
            traceback.print_exc()  # into the service's log
            writer.writelines(frame(dumps(Failed(one_line(e), ""))))
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await writer.drain()
                await asyncio.wait_for(_until_closed(reader), REFUSAL_SECONDS)
        if factory is not None:
            await off_loop(factory.close)
        return None

    async def _rank_factory(self, init: ServiceInit) -> PassFactory:
        """A rank's passes: its own epochs, position and division; the node's reads,
        storage, decode processes, blocks and memory limit."""
        if self._share is None:
            init.environment.take_on()
            config: LoaderConfig = pickle.loads(init.code)
            init.environment.filter_warnings()  # the categories the configuration imported
            await off_loop(Zygote.get().preload, list(init.packages))
            self._share = NodeShare(config, rendezvous.local_ranks())
            self._fingerprint = init.fingerprint
        elif init.fingerprint != self._fingerprint:
            raise LoaderError(
                "this node's loader service serves another configuration (fingerprint "
                f"{self._fingerprint[:12]}, this rank's is {init.fingerprint[:12]})")
        else:  # a large dataset takes a while: the other ranks' passes go on meanwhile
            config = await off_loop(pickle.loads, init.code)
        return PassFactory(dataclasses.replace(config, service=None), export=True,
                           share=self._share)

    def _take_removed(self, key: int) -> list[str]:
        """Blocks unlinked since rank `key` was last told: every rank is told of each."""
        share = self._share
        fresh = share.blocks.take_removed() if share is not None and share.blocks else []
        for pending in self._removed.values():
            pending.extend(fresh)
        taken, self._removed[key] = self._removed.get(key, []), []
        return taken

    def _warn(self, message: Warning | str, category: type[Warning], filename: str,
              lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        """A warning here (a decode process restarted) concerns every rank."""
        for service in list(self._services.values()):
            service.warn(message, category, filename, lineno, file, line)


async def _until_closed(reader: asyncio.StreamReader) -> None:
    """Read (and drop) what a refused peer still sends, until it closes: closing with its
    bytes unread would reset the connection, and the peer would never read why."""
    while await reader.read(1 << 16):
        pass


def _check_peer(sock: socket.socket) -> None:
    """Refuse a peer of another user (the folder already keeps them out, but not root)."""
    pid, uid = rendezvous.peer_uid(sock)
    if uid != os.getuid():
        raise LoaderError(f"this loader service belongs to user {os.getuid()}; process {pid} "
                          f"of user {uid} may not use it")


if __name__ == "__main__":
    sys.exit(main())
