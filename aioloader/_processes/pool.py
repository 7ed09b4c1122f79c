"""The decode processes: forked by the zygote, each served by two threads of this process (one
pickles and sends, one receives and unpickles), so that no event loop ever waits on a pipe and
the pool belongs to no loop: a pass listens to it from whichever loop it runs in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._closing import ProcessBound
from .._errors import LoaderError
from .._ipc.channel import Channel, dumps, dumps_data
from .._ipc.messages import STOP, Environment, Imported, Init, Ready
from .._worker.decode import DecodeSpec
from .zygote import Zygote

STOP_GRACE_SECONDS = 2.0
"""How long a closing pool lets a busy decode process finish before it is killed."""
JOIN_SECONDS = 5.0

Listener = Callable[["DecodeProcess", Any], None]
LOST = "lost"
"""Delivered when a process's channel ends: it exited or was killed."""


class DecodeProcess(ProcessBound):
    """One decode process: its pid, its channel, and the two threads that move messages."""

    def __init__(self, worker_id: int, init: bytes, deliver: Callable[[DecodeProcess, Any], None]):
        super().__init__()
        ours, theirs = socket.socketpair()
        try:
            with theirs:
                self.pid = Zygote.get().spawn(theirs)
        except BaseException:
            ours.close()  # a process forked all the same sees its channel end, and exits
            raise
        self.id = worker_id
        self.ready = False
        self.settled = threading.Event()
        """Set once it said it is ready, or its channel ended (it failed to start, or died)."""
        self.alive = True
        """False once the channel ended (the process exited or was killed)."""
        self.retired = False
        """Killed on purpose (it held work of a pass that ended); replaced before reuse."""
        self._channel = Channel(ours)
        self._deliver = deliver
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outbox.put(init)
        self._threads = [
            threading.Thread(target=self._send_all, name=f"aioloader-decode-{worker_id}-send",
                             daemon=True),
            threading.Thread(target=self._receive_all,
                             name=f"aioloader-decode-{worker_id}-receive", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def __repr__(self) -> str:
        return f"decode process {self.id} (pid {self.pid})"

    def send(self, message: Any) -> None:
        """Queue a message; it is pickled and sent on this process's sending thread."""
        self._outbox.put(message)

    def _send_all(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._channel.send_bytes(
                    message if isinstance(message, bytes) else dumps_data(message))
            except OSError:
                return  # the process is gone; the receiving thread reports it
            del message  # sent: its raw items are not held here until the next

    def _receive_all(self) -> None:
        try:
            while True:
                message = self._channel.receive()
                if isinstance(message, Imported):
                    Zygote.get().learn(message.packages)
                    continue
                if isinstance(message, Ready):
                    self.ready = True
                    self.settled.set()
                self._deliver(self, message)
                del message  # not held while the next is awaited: a result's block is lent
        except (EOFError, OSError):
            self.alive = False
            self.settled.set()
            self._deliver(self, LOST)

    def kill(self) -> None:
        if self.foreign:  # a forked child's copy: the process is the parent's
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def retire(self) -> None:
        """Kill a process whose work belongs to a pass that is over; the pool replaces it."""
        self.retired = True
        self.kill()

    def close(self) -> None:
        """End the channel and the threads; a live process sees the end of its channel and
        exits. Joins are bounded. A forked child's copy only closes its copy of the socket:
        shutting it down would end the parent's channel too."""
        if self.foreign:
            self._channel.close()
            return
        self._outbox.put(None)
        with contextlib.suppress(OSError):
            self._channel.socket.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_SECONDS)
        self._channel.close()


class DecodePool(ProcessBound):
    """`num_workers` decode processes running one decode spec; replaced one by one on death.

    The pool delivers every message to the listener of the moment (a pass), in that listener's
    event loop; with no listener, messages are dropped (they belong to a pass that is over).
    """

    def __init__(
        self,
        spec: DecodeSpec,
        num_workers: int,
        base_seed: int,
        worker_init: Callable[[int], Any] | None,
    ) -> None:
        if not hasattr(socket, "send_fds"):
            raise RuntimeError(f"decode processes need a POSIX system; on {sys.platform} use "
                               "num_workers=0 or executor=")
        super().__init__()
        self.num_workers = num_workers
        self._init = Init(
            code=dumps((spec, worker_init)), worker_id=0, num_workers=num_workers,
            seed=base_seed, environment=Environment.here(),
        )
        self._lock = threading.Lock()
        self._listener: tuple[asyncio.AbstractEventLoop, Listener] | None = None
        self._membership = threading.Lock()
        """Held while processes are replaced or the pool closes: none starts after close."""
        self.processes = [self._start(worker_id) for worker_id in range(num_workers)]
        self.closed = False

    def _start(self, worker_id: int) -> DecodeProcess:
        init = dataclasses.replace(self._init, worker_id=worker_id)
        return DecodeProcess(worker_id, dumps(init), self._deliver)

    def listen(
        self, listener: Listener | None, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """Deliver messages to `listener` in `loop` from now on (None: drop them)."""
        if self.foreign:  # nothing comes to a forked child; no lock a parent's thread held
            return
        with self._lock:
            self._listener = None if listener is None or loop is None else (loop, listener)

    def _deliver(self, process: DecodeProcess, message: Any) -> None:
        with self._lock:
            listener = self._listener
        if listener is not None:
            loop, function = listener
            with contextlib.suppress(RuntimeError):  # the loop closed: the pass is over
                loop.call_soon_threadsafe(function, process, message)

    def replace(self, process: DecodeProcess) -> DecodeProcess:
        """A new process in the place of `process`, which is killed if it still runs."""
        process.kill()
        with self._membership:
            if self.closed:
                raise LoaderError("the decode pool was closed")
            fresh = self._start(process.id)
            self.processes[process.id] = fresh
        threading.Thread(target=process.close, name="aioloader-decode-reap", daemon=True).start()
        return fresh

    def wait_settled(self, timeout: float) -> None:
        """Wait (up to `timeout` s in all) until each process has said it is ready (its
        decode's modules imported, worker_init run) or has ended."""
        deadline = time.monotonic() + timeout
        for process in list(self.processes):
            process.settled.wait(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def exit_status(process: DecodeProcess, wait: float) -> int | None:
        """How `process` ended (negative: the signal), waiting up to `wait` s; None if it runs."""
        return Zygote.get().exit_status(process.pid, wait)

    def close(self) -> None:
        """Stop the processes: idle ones exit at once, busy ones get a grace period, then a
        kill. Blocking (bounded): call it off the event loop. In a forked child, let go of the
        copies of the parent's channels only."""
        if self.foreign:
            for process in self.processes:
                process.close()
            return
        with self._membership:
            if self.closed:
                return
            self.closed = True
        self.listen(None)
        for process in self.processes:
            process.send(STOP)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        zygote = Zygote.running()  # None: the processes died with the one that forked them
        for process in self.processes:
            if zygote is None:
                break
            if zygote.exit_status(process.pid, max(0.0, deadline - time.monotonic())) is None:
                process.kill()
                zygote.exit_status(process.pid, STOP_GRACE_SECONDS)
        for process in self.processes:
            process.close()
