"""The training process's side of a loader service: a thin client on a socket.

The service (`aioloader._service`) runs the passes: reads, decode processes, hand-over. Here,
`next()` waits on the socket with the GIL released, and maps the batch's shared-memory block:
the arrays the trainer gets are views of the block the decode process wrote, never copied. When
the trainer drops the last of them, the block's name goes back with the next message.

The messages both ways are in `messages`.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import pickle
import select
import signal
import socket
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from .._closing import ProcessBound
from .._errors import LoaderError, RemoteTraceback
from .._ipc import shm
from .._ipc.channel import Channel, dumps_data
from .._ipc.messages import Environment
from .._ipc.transport import Exported, views
from .._processes.zygote import START_TIMEOUT, Zygote
from .._stats import LoaderStats
from .messages import (
    Alive,
    AskStats,
    Batch,
    ClientMessage,
    End,
    Error,
    Open,
    PassMessage,
    Prepare,
    Prepared,
    Ready,
    Removed,
    ServiceInit,
    Stats,
    Stop,
    Stopped,
    Take,
    Waiting,
    Warned,
)

AHEAD = 2
"""Batches the service may send before the trainer takes them: one to train on, one ready."""
STOP_SECONDS = 5.0
"""How long closing waits for the service to end before it is killed."""
EXTRA_SECONDS = 60.0
"""Beyond `stall_timeout` (the service's own watchdog), how long to wait for a message while
the service's heartbeat says it lives."""
HEARTBEAT_SECONDS = 1.0
"""How often a service says it lives (an "alive" message), whatever else it sends."""
SILENCE_SECONDS = 15.0
"""Nothing at all, not even a heartbeat, for this long: the service is stopped (SIGSTOP, a
debugger) or its loop is wedged, and waiting for its watchdog would take `stall_timeout`."""


class ServiceClient(ProcessBound):
    """A connection to a loader service, and the pass it runs for this process: a service
    started for this process alone (`spawn`), or a node's, shared with the other ranks
    (`shared`: closing leaves it running for them)."""

    def __init__(self, sock: socket.socket, pid: int, stall_timeout: float, shared: bool = False
                 ) -> None:
        super().__init__()
        self.pid = pid
        self.shared = shared
        self._channel = Channel(sock)
        self._timeout = stall_timeout + EXTRA_SECONDS
        self._stream: deque[PassMessage] = deque()
        """Messages of the pass stream (batches, its end), in order."""
        self._replies: deque[bytes] = deque()
        """Stats snapshots asked for."""
        self._prepared = 0
        """`Prepared` answers received."""
        self._released: deque[str] = deque()
        """Blocks whose last view died here, not yet told to the service."""
        self._maps: dict[str, mmap.mmap] = {}
        """Blocks mapped here, kept while the service keeps them: it reuses its blocks, so a
        batch costs no mapping; dropped when the service says it removed one."""
        self._receiving = threading.Lock()
        self._sending = threading.Lock()
        self._arrived = threading.Condition()
        self._discarding = 0
        """Passes stopped whose "stopped" has not come yet: their messages are dropped."""
        self.broken: str | None = None
        """Why this connection can no longer be used (the service was lost, a message was
        cut short); the Loader then starts another service."""
        self.closed = False
        self.pass_open = False
        """A pass was opened and has not ended, failed or been stopped."""
        self._received = 0
        """Batches of the open pass received."""
        self.last_stats: bytes | None = None
        self._heard_at = time.monotonic()
        """When the last message of any kind arrived."""

    @classmethod
    def spawn(cls, code: bytes, packages: list[str], stall_timeout: float) -> ServiceClient:
        """A loader service of this process's own, forked by its zygote."""
        ours, theirs = socket.socketpair()
        try:
            with theirs:
                pid = Zygote.get().spawn_service(theirs, packages)
        except BaseException:
            ours.close()
            raise
        client = cls(ours, pid, stall_timeout)
        try:
            client.introduce(ServiceInit(code, Environment.here()))
        except (OSError, EOFError) as e:
            raise LoaderError(f"the loader service (pid {pid}) did not start: {e}") from e
        return client

    def introduce(self, init: ServiceInit) -> None:
        """Send the configuration; return once the service has built its Loader from it.
        OSError or EOFError: the service went away before answering (closed here)."""
        sock = self._channel.socket
        sock.settimeout(START_TIMEOUT)
        try:
            self._channel.send(init)
            reply = self._channel.receive()
        except BaseException:
            self.close()
            raise
        if not isinstance(reply, Ready):
            self.close()
            raise LoaderError(f"the loader service could not be set up: {reply.reason}") from (
                RemoteTraceback(reply.traceback) if reply.traceback else None)
        self.pid = reply.pid
        sock.settimeout(SILENCE_SECONDS)

    # -- the pass ---------------------------------------------------------------------------

    def open(self, epoch: int, start: int, remaining: tuple[tuple[int, int], ...] | None,
             copies: dict[str, Any] | None) -> None:
        self._send(Open(self._take_released(), epoch, start, remaining, copies, AHEAD,
                        Environment.here()))
        self.pass_open = True
        self._received = 0

    def next(self) -> tuple[Any, int, dict[str, Any] | None] | None:
        """The next batch and where the pass stands after it (its position, an
        IterableDataset's copies), or None at the end of the pass."""
        started = time.monotonic()
        self._say_if_waiting()
        while (message := self._pop()) is None:
            self._wait(lambda: bool(self._stream), started)
        return self._deliver(message)

    def _say_if_waiting(self) -> None:
        """Tell the service the trainer waits, when nothing has come: the batch it needs next
        may be decoded past the memory limit (batches asked ahead may not). The count of
        batches received lets the service tell one still on its way."""
        if not self._stream:
            self._send(Waiting(self._take_released(), self._received))

    async def next_async(self) -> tuple[Any, int, dict[str, Any] | None] | None:
        """`next()` for `async for`: the caller's loop waits for the socket to be readable,
        in short slices, so that a message another thread (asking for `stats`) received
        meanwhile is seen."""
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        self._say_if_waiting()
        while (message := self._pop()) is None:
            if not self._channel.buffered:
                await self._readable(loop, started)
            if self._receiving.acquire(blocking=False):
                try:
                    if not self._stream and (self._channel.buffered or _ready(
                            self._channel.socket)):
                        self._dispatch(started)
                finally:
                    self._receiving.release()
        return self._deliver(message)

    async def _readable(self, loop: asyncio.AbstractEventLoop, started: float) -> None:
        readable = loop.create_future()
        descriptor = self._channel.socket.fileno()
        loop.add_reader(descriptor, _resolve, readable)
        try:
            await asyncio.wait({readable}, timeout=0.05)
        finally:
            loop.remove_reader(descriptor)
        heard = max(self._heard_at, started)
        if not readable.done() and time.monotonic() - heard > SILENCE_SECONDS:
            self.broken = "it stopped answering"
            raise self._silent(heard)
        if time.monotonic() - started > self._timeout:
            raise self._stalled(started)

    def stop(self, wait: bool = True) -> None:
        """End the pass before its end: the batches already sent are dropped (their blocks
        released). `wait`: until the service has closed the pass."""
        self._discarding += 1
        self.pass_open = False
        self._send(Stop(self._take_released()))
        if wait:
            started = time.monotonic()
            while self._discarding:
                if self._pop() is None:
                    self._wait(lambda: bool(self._stream) or not self._discarding, started)

    def stats(self) -> bytes:
        """A snapshot of the service's stats, pickled."""
        started = time.monotonic()
        self._send(AskStats(self._take_released()))
        self._wait(lambda: bool(self._replies), started)
        return self._replies.popleft()

    def start_decoding(self, epoch: int) -> None:
        """Return once the decode processes a pass of `epoch` would use are ready."""
        started, answered = time.monotonic(), self._prepared + 1
        self._send(Prepare(self._take_released(), epoch))
        self._wait(lambda: self._prepared >= answered, started)

    def _pop(self) -> PassMessage | None:
        """The next message of the current pass; those of a stopped pass are dropped."""
        while self._stream:
            message = self._stream.popleft()
            if not self._discarding:
                return message
            if isinstance(message, Stopped):
                self._discarding -= 1
                self.last_stats = message.stats
            elif isinstance(message, Batch) and isinstance(message.item, Exported):
                self._released.append(message.item.name)
        return None

    def _deliver(self, message: PassMessage) -> tuple[Any, int, dict[str, Any] | None] | None:
        if isinstance(message, Batch):
            self._received += 1
            item = message.item
            if isinstance(item, Exported):
                name = item.name
                block = self._maps.get(name)
                if block is None:
                    block = self._maps[name] = shm.attach_block(name)
                item = views(block, item.value, lambda: self._released.append(name))
            self._send(Take(self._take_released()))
            return item, message.position, message.copies
        self.last_stats = message.stats
        if isinstance(message, Error) and not message.final:  # one batch's: the pass goes on
            self._send(Take(self._take_released()))
        else:
            self.pass_open = False
        if isinstance(message, End):
            return None
        assert isinstance(message, Error), message
        error = message.error
        if message.cause:
            error.__cause__ = RemoteTraceback(message.cause)
        raise error

    # -- the socket -------------------------------------------------------------------------

    def _take_released(self) -> list[str]:
        names = []
        while self._released:
            names.append(self._released.popleft())
        return names

    def _check_usable(self) -> None:
        if self.foreign:
            raise LoaderError(f"this loader service (pid {self.pid}) belongs to process "
                              f"{self.owner_pid}; this process is a child forked from it")
        if self.broken is not None:
            raise LoaderError(f"the loader service (pid {self.pid}) cannot be used: "
                              f"{self.broken}")

    def _send(self, message: ClientMessage) -> None:
        self._check_usable()
        data = dumps_data(message)  # an open's warning filters may name classes of __main__
        try:
            with self._sending:
                self._channel.send_bytes(data)
        except OSError as e:
            self.broken = "it was lost"
            raise self._lost(e) from None

    def _wait(self, ready: Callable[[], bool], started: float) -> None:
        """Receive until `ready()`; another thread may be the one receiving (a pass in one,
        `stats` in another), and hands over what it receives."""
        while not ready():
            if self._receiving.acquire(timeout=0.05):
                try:
                    if not ready():
                        self._dispatch(started)
                finally:
                    self._receiving.release()
            else:
                with self._arrived:
                    self._arrived.wait_for(ready, 0.05)
            if time.monotonic() - started > self._timeout:
                raise self._stalled(started)

    def _dispatch(self, started: float) -> None:
        self._check_usable()
        try:
            message = self._channel.receive()
        except TimeoutError:
            self.broken = "it stopped answering"
            raise self._silent(started) from None
        except (OSError, EOFError) as e:
            self.broken = "it was lost"
            raise self._lost(e) from None
        except BaseException:  # Ctrl-C mid-message: what is left of it cannot be found again
            self.broken = "a message from it was cut short"
            raise
        self._heard_at = time.monotonic()
        if isinstance(message, Alive):
            return
        if isinstance(message, Warned):
            warnings.warn(message.message, message.category, stacklevel=3)
            return
        if isinstance(message, Removed):  # views still held keep their mapping alive
            for name in message.names:
                self._maps.pop(name, None)
            return
        if isinstance(message, Stats):
            self._replies.append(message.stats)
        elif isinstance(message, Prepared):
            self._prepared += 1
        else:
            self._stream.append(message)
        with self._arrived:
            self._arrived.notify_all()

    def _stalled(self, started: float) -> LoaderError:
        """Its heartbeat went on, but neither a batch nor its watchdog's error came."""
        return LoaderError(f"the loader service (pid {self.pid}) sent no answer for "
                           f"{time.monotonic() - started:.0f} s though it still lives: its "
                           "watchdog (stall_timeout) did not report")

    def _silent(self, started: float) -> LoaderError:
        return LoaderError(f"the loader service (pid {self.pid}) sent nothing for "
                           f"{time.monotonic() - started:.0f} s, not even its heartbeat: it is "
                           "stopped (SIGSTOP, a debugger) or its event loop is blocked")

    def _lost(self, error: BaseException) -> LoaderError:
        if self.closed:
            return LoaderError("the Loader was closed while a pass was running")
        zygote = None if self.foreign or self.shared else Zygote.running()
        status = None if zygote is None else zygote.exit_status(self.pid, 1.0)
        how = "" if status is None else (
            f" (killed by {signal.Signals(-status).name})" if status < 0 else
            f" (exit status {status})")
        return LoaderError(f"lost the loader service (pid {self.pid}){how}: {error}")

    def close(self) -> None:
        """End the service: its passes, decode processes and blocks go with it (bounded). A
        node's service only ends this rank's passes (it ends itself after its last rank). In a
        forked child, only let go of this copy of the socket."""
        if self.closed:
            return
        self.closed = True
        self._maps.clear()
        if self.foreign:
            self._channel.close()
            return
        if self.shared:
            with contextlib.suppress(OSError):
                self._channel.socket.shutdown(socket.SHUT_RDWR)
            self._channel.close()
            return
        with contextlib.suppress(OSError):
            self._channel.socket.shutdown(socket.SHUT_RDWR)
        zygote = Zygote.running()  # None: the service died with the one that forked it
        with contextlib.suppress(LoaderError):
            if zygote is not None and zygote.exit_status(self.pid, STOP_SECONDS) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                zygote.exit_status(self.pid, STOP_SECONDS)
        self._channel.close()


def _ready(sock: socket.socket) -> bool:
    """Whether `sock` has something to read now."""
    return bool(select.select([sock], [], [], 0)[0])


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def load_stats(data: bytes) -> LoaderStats:
    stats: LoaderStats = pickle.loads(data)
    return stats
