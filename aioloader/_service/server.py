"""A loader service: the process that runs a Loader's passes beside the trainer.

The zygote forks it (`run`), so it starts with aioloader imported and none of the user's main
module; the configuration arrives by value, and passes are built from it here (`PassFactory`,
as a Loader and a node's service build theirs). Its event loop reads, schedules decoding and
hands batches over, in a process of its own: a training step that holds the GIL no longer
slows it. Its decode processes come from the same zygote, over a control
socket of its own; when the service ends or is killed, the zygote kills them and removes the
blocks named with the service's pid. It dies with the zygote, which dies with the trainer.

Batches go out as `Exported` parts (the block's name and the places of the arrays), which the
client maps; the service holds the block until the client says the last view is gone. The
client's side is in `client`, the messages in `messages`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import pickle
import signal
import socket
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from .._blocking import off_loop
from .._config import LoaderConfig
from .._errors import LoaderError, RemoteTraceback
from .._ipc.channel import Channel, Parts, dumps, dumps_data, frame, read_message
from .._ipc.transport import Exported
from .._loopthread import new_event_loop
from .._pass.factory import PassFactory
from .._pass.pipeline import END, Pass
from .._processes.zygote import Zygote
from .._stats import snapshot
from .._worker.decode import one_line
from .client import HEARTBEAT_SECONDS
from .messages import (
    Alive,
    AskStats,
    Batch,
    ClientMessage,
    End,
    Error,
    Failed,
    Open,
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


def run(descriptor: int, zygote_descriptor: int, zygote_pid: int) -> int:
    """The service's life, in a process the zygote forked: take on the trainer's settings,
    then serve its passes until it closes its end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    Zygote.adopt(socket.socket(fileno=zygote_descriptor), zygote_pid)
    sock = socket.socket(fileno=descriptor)
    channel = Channel(sock)
    try:
        init: ServiceInit = channel.receive()
        init.environment.take_on()
        config: LoaderConfig = pickle.loads(init.code)
        init.environment.filter_warnings()  # the categories the configuration imported
        factory = PassFactory(dataclasses.replace(config, service=None), export=True)
    except BaseException as e:
        with contextlib.suppress(OSError):
            channel.send(Failed(one_line(e), traceback.format_exc()))
        return 1
    channel.send(Ready(os.getpid()))
    loop = new_event_loop()
    blocks = factory.blocks
    service = Service(factory, blocks.take_removed if blocks is not None else list)
    warnings.showwarning = service.warn
    try:
        loop.run_until_complete(_serve_socket(service, sock))
    finally:
        factory.close()
        loop.close()
    return 0


async def _serve_socket(service: Service, sock: socket.socket) -> None:
    sock.setblocking(False)
    await service.serve(*await asyncio.open_unix_connection(sock=sock))


class Service:
    """One client's passes, one at a time, built by a factory in this process.
    `take_removed` gives the blocks unlinked since the client was last told. `own_process`:
    the process is this client's alone, so each pass takes on the client's environment (a
    node's service keeps the first rank's: its ranks' passes run side by side)."""

    def __init__(self, factory: PassFactory, take_removed: Callable[[], list[str]],
                 own_process: bool = True) -> None:
        self._factory = factory
        self._take_removed = take_removed
        self._own_process = own_process
        self._sent: collections.Counter[str] = collections.Counter()
        """Holds on blocks taken for the client and not released by it yet."""
        self._writer: asyncio.StreamWriter | None = None
        self._credits = asyncio.Semaphore(0)
        self._pass: asyncio.Task[None] | None = None
        self._running: Pass | None = None
        """The pass `_pass` runs, once open."""
        self._sent_in_pass = 0
        self._client_waits = False
        """The client waits for a batch, none being on its way: the pass's next batch may
        be decoded past the memory limit."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._loop, self._thread = asyncio.get_running_loop(), threading.get_ident()
        beat = self._loop.create_task(self._beat())
        self._factory.budget.on_shed.append(self._tell_removed)
        try:
            while True:
                await self._answer(await read_message(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the trainer closed its end, or died
        finally:
            self._factory.budget.on_shed.remove(self._tell_removed)
            beat.cancel()
            await self._stop()
            self._writer.close()
            self._give_back()

    async def _beat(self) -> None:
        """Say this process lives, every second: a client that hears nothing at all knows it
        is stopped or wedged within seconds, not after `stall_timeout`."""
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            self._send(Alive())

    def _give_back(self) -> None:
        """Blocks the client held when it left (closed, or killed) are unlinked: a trainer's
        views, if it lives on, keep their memory, and the pool its room."""
        blocks = self._factory.blocks
        if blocks is not None:
            for name in self._sent:
                blocks.retire(name)
        self._sent.clear()

    async def _answer(self, message: ClientMessage) -> None:
        if isinstance(message, Open):
            await self._stop()
        self._release(message.released)
        if isinstance(message, Open):
            if self._own_process:
                message.environment.take_on()
            self._credits = asyncio.Semaphore(message.ahead)
            self._sent_in_pass, self._client_waits = 0, False
            self._pass = asyncio.get_running_loop().create_task(
                self._run_pass(message.epoch, message.start, message.remaining,
                               message.copies))
        elif isinstance(message, Take):
            self._credits.release()
        elif isinstance(message, Waiting) and message.received >= self._sent_in_pass:
            self._client_waits = True
            if self._running is not None:
                self._running.hurry()
        elif isinstance(message, Stop):
            await self._stop()
            self._send(Stopped(self._stats()))
        elif isinstance(message, AskStats):
            self._send(Stats(self._stats()))
        elif isinstance(message, Prepare):
            await off_loop(self._factory.start_decoding, message.epoch)
            self._send(Prepared())

    async def _run_pass(self, epoch: int, start: int, remaining: Any, copies: Any) -> None:
        running = self._running = await self._open_or_report(epoch, start, remaining, copies)
        if running is None:
            return
        try:
            while True:
                await self._credits.acquire()
                try:
                    item = await running.next(waits=self._client_waits)
                    self._client_waits = False
                    handed, item = self._hand_over(item, running), None  # the block is the
                    if not handed:  # client's alone now: released when the client says so
                        return
                except Exception as e:  # a batch's or the pass's failure, or one that cannot travel
                    self._send(Error(*_portable(e), self._stats(), final=not running.goes_on))
                    if running.goes_on:
                        continue
                    return
                assert self._writer is not None
                await self._writer.drain()
        finally:
            self._running = None
            await running.aclose()
            self._tell_removed()  # blocks the pass's close removed: the client unmaps them now

    def _hand_over(self, item: Any, running: Pass) -> bool:
        """Send a batch (False: the end of the pass). Pickled first: a block is held for the
        client only once its batch surely goes out."""
        if item is END:
            self._send(End(self._stats()))
            return False
        data = dumps_data(Batch(item, running.position, running.copies))
        blocks = self._factory.blocks
        if isinstance(item, Exported) and blocks is not None:
            blocks.hold(item.name)  # the client's, until it releases it
            self._sent[item.name] += 1
        self._write(data)
        self._sent_in_pass += 1
        return True

    async def _open_or_report(self, epoch: int, start: int, remaining: Any, copies: Any
                              ) -> Pass | None:
        try:
            return await self._factory.open(epoch, start, remaining, copies)
        except Exception as e:
            self._send(Error(*_portable(e), self._stats()))
            return None

    async def _stop(self) -> None:
        """End the running pass, if any: its tasks, decode work and blocks."""
        running, self._pass = self._pass, None
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running

    def warn(self, message: Warning | str, category: type[Warning], filename: str,
             lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
        """A warning here (a decode process restarted, /dev/shm full) is the trainer's to see;
        one raised on another thread (a storage thread's) is sent from the loop's."""
        sent = Warned(category, str(message))
        if threading.get_ident() == self._thread or self._loop is None:
            self._send(sent)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                self._loop.call_soon_threadsafe(self._send, sent)

    def _release(self, names: list[str]) -> None:
        blocks = self._factory.blocks
        if blocks is not None:
            for name in names:
                blocks.release(name)
                self._sent[name] -= 1
                if self._sent[name] <= 0:
                    del self._sent[name]

    def _stats(self) -> bytes:
        return pickle.dumps(snapshot(self._factory.stats), pickle.HIGHEST_PROTOCOL)

    def _send(self, message: Alive | Stopped | Stats | End | Error | Warned | Prepared
              ) -> None:
        self._write(dumps(message))

    def _write(self, data: bytes | Parts) -> None:
        """One message, after telling the client of the blocks removed since the last."""
        self._tell_removed()
        self._frame(data)

    def _tell_removed(self) -> None:
        removed = self._take_removed()
        if removed:
            self._frame(dumps(Removed(removed)))

    def _frame(self, data: bytes | Parts) -> None:
        assert self._writer is not None
        if not self._writer.is_closing():
            self._writer.writelines(frame(data))


def _portable(error: BaseException) -> tuple[BaseException, str]:
    """An error as it can travel, and the text of its cause: a decode process's traceback,
    or where it was raised here."""
    cause = error.__cause__
    text = cause.text if isinstance(cause, RemoteTraceback) else "".join(
        traceback.format_exception(error))
    try:
        pickle.loads(dumps(error))
    except Exception:
        error = LoaderError(f"{type(error).__name__}: {error}")
    return error, text
