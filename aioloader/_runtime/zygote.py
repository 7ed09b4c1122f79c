"""The zygote: one small process per interpreter that forks decode processes and cleans up
after its parent.

It is started with `python -m aioloader._runtime.zygote_main`, so it has imported aioloader
and numpy but never the user's main module; a decode process forked from it starts in
milliseconds and runs no user code but what reaches it by value (cloudpickle). It also
watches its parent: when the parent dies, even by SIGKILL, the zygote kills the decode
processes and removes the parent's shared memory (and named caches it was the last member
of). Decode processes die with the zygote (PR_SET_PDEATHSIG on Linux).

Protocol on the control socket (a `Channel`): a request `(number, kind, argument)`, then its
reply `(number, answer)`, one at a time. A reply carries its request's number, so one that comes
after its request timed out is dropped rather than taken for the answer to the next request.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from .._closing import ProcessBound
from .._errors import LoaderError
from .channel import Channel

START_TIMEOUT = 60.0
REPLY_TIMEOUT = 30.0
POLL_SECONDS = 0.25
"""How often the zygote checks that its parent is alive and reaps its children."""


# -- the parent's side ----------------------------------------------------------------------


class Zygote(ProcessBound):
    """The client of this interpreter's zygote, started on first use."""

    _instance: ClassVar[Zygote | None] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls) -> Zygote:
        with cls._instance_lock:
            if cls._instance is None or not cls._instance.alive():
                if cls._instance is not None:  # it died: let go of its socket
                    cls._instance._channel.close()
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._learned: set[str] = set()
        self._numbers = itertools.count(1)
        ours, theirs = socket.socketpair()
        package_parent = str(Path(__file__).resolve().parents[2])
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_parent, environment.get("PYTHONPATH")) if p
        )
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "aioloader._runtime.zygote_main",
                 str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=environment,
            )
        self._channel = Channel(ours)
        ours.settimeout(START_TIMEOUT)
        try:
            ready = self._channel.receive()
        except (OSError, EOFError):
            ready = None
        if ready != "ready":
            self._process.kill()
            self._process.wait(START_TIMEOUT)
            self._channel.close()
            raise LoaderError("the process that starts decode processes did not start")
        ours.settimeout(REPLY_TIMEOUT)

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return not self.foreign and self._process.poll() is None

    def _request(self, kind: str, argument: Any, fds: Sequence[int] = ()) -> Any:
        """Send a request and wait for its own reply; replies to earlier requests that timed
        out are read and dropped on the way."""
        with self._lock:
            number = next(self._numbers)
            try:
                self._channel.send((number, kind, argument), fds)
                while True:
                    answered, reply = self._channel.receive()
                    if answered == number:
                        return reply
            except TimeoutError as e:
                raise LoaderError(
                    f"the process that starts decode processes (pid {self.pid}) did not answer "
                    f"a {kind} request within {self._channel.socket.gettimeout():g} s"
                ) from e
            except (OSError, EOFError) as e:
                raise LoaderError(
                    f"lost the process that starts decode processes (pid {self.pid}): {e}"
                ) from e

    def spawn(self, channel: socket.socket) -> int:
        """Fork a decode process that serves `channel`; its pid. Packages decode processes
        were seen to import are imported by the zygote first, once, so that later decode
        processes start with them (a pass that imports torch pays for it once, not per pass)."""
        with self._lock:
            preload, self._learned = sorted(self._learned), set()
        pid: int = self._request("spawn", preload, [channel.fileno()])
        return pid

    def preload(self, packages: list[str]) -> None:
        """Import installed packages now, before any decode process is forked."""
        self._request("preload", packages)

    def learn(self, packages: list[str]) -> None:
        """Installed packages a decode process imported: the next spawn preloads them."""
        with self._lock:
            self._learned.update(packages)

    def exit_status(self, pid: int, wait: float = 0.0) -> int | None:
        """The exit status of a decode process as subprocess reports it (negative: killed by
        that signal), or None while it runs; waits up to `wait` seconds for it to end."""
        deadline = time.monotonic() + wait
        while True:
            status: int | None = self._request("status", pid)
            if status is not None or time.monotonic() >= deadline:
                return status
            time.sleep(0.01)

    def watch_cache(self, name: str, watching: bool) -> None:
        """Have the named cache removed should this process die as its last member."""
        self._request("watch" if watching else "unwatch", name)


def _forget_in_child() -> None:
    """A forked copy of the parent must not talk on the parent's control socket: it lets go of
    its copy of the socket (the parent's end stays open) and starts a zygote of its own if it
    needs one."""
    inherited = Zygote._instance
    Zygote._instance = None
    Zygote._instance_lock = threading.Lock()
    if inherited is not None:
        inherited._channel.close()


os.register_at_fork(after_in_child=_forget_in_child)


# -- the zygote's side --------------------------------------------------------------------------


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the zygote) dies."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class _Server:
    def __init__(self, control: Channel, parent: int) -> None:
        self.control = control
        self.parent = parent
        self.children: set[int] = set()
        self.statuses: dict[int, int] = {}
        self.caches: set[str] = set()

    def serve(self) -> None:
        self.control.send("ready")
        try:
            while os.getppid() == self.parent:
                readable, _, _ = select.select([self.control.socket], [], [], POLL_SECONDS)
                self.reap()
                if readable:
                    (number, kind, argument), fds = self.control.receive_with_fds()
                    self.control.send((number, self.answer(kind, argument, fds)))
        except (EOFError, OSError):
            pass  # the parent closed its end: it exited or died
        finally:
            self.clean_up()

    def answer(self, kind: str, argument: Any, fds: list[int]) -> Any:
        if kind == "spawn":
            preload(argument)
            return self.fork(fds[0])
        if kind == "preload":
            preload(argument)
            return "ok"
        if kind == "status":
            self.reap()
            return self.statuses.get(argument)
        (self.caches.add if kind == "watch" else self.caches.discard)(argument)
        return "ok"

    def fork(self, channel: int) -> int:
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.control.close()
                die_with_parent()
                if os.getppid() != zygote:  # the zygote died before the request took effect
                    os._exit(1)
                from .worker import serve

                code = serve(channel)
            finally:
                os._exit(code)
        os.close(channel)
        self.children.add(pid)
        return pid

    def reap(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.children.discard(pid)
                    self.statuses[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else (
                        os.WEXITSTATUS(status))

    def clean_up(self) -> None:
        """Decode processes first (none may create a segment after the sweep), then the
        parent's shared memory, if the parent is gone."""
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)
        from .._cache import remove_if_unused
        from .shm import remove_leftovers

        remove_leftovers(self.parent)
        for name in self.caches:
            remove_if_unused(name)


def preload(packages: list[str]) -> None:
    """Import installed packages so forked decode processes have them; one that fails to
    import is left to the decode process, as before."""
    for name in packages:
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)  # runs the clean-up on the way out


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _exit_on_term)
    from . import worker  # noqa: F401  (with numpy and cloudpickle: what every decode process runs)

    preload(["PIL.Image"])  # most decode functions decode images; later, what they were seen to use
    with socket.socket(fileno=int(sys.argv[1])) as control:
        _Server(Channel(control), int(sys.argv[2])).serve()
