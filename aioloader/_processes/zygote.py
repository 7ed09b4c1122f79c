"""The client of the zygote: one small process per interpreter that forks decode processes and
cleans up after its parent (the process itself is `zygote_main`).

The zygote is started on first use, as `python -m aioloader._processes.zygote_main`, so it has
imported aioloader and numpy but never the user's main module. This module imports neither the
decode code nor the cache: the cache uses it to have its segments removed should this process
die.

Protocol on the control socket (a `Channel`): a request `(number, kind, argument)`, then its
reply `(number, answer)`, one at a time. A reply carries its request's number, so one that comes
after its request timed out is dropped rather than taken for the answer to the next request.
"""

from __future__ import annotations

import itertools
import os
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
from .._ipc.channel import Channel

START_TIMEOUT = 60.0
REPLY_TIMEOUT = 30.0
LOCK_TIMEOUT = 2 * REPLY_TIMEOUT
"""A request waits this long at most for the one before it (itself bounded by REPLY_TIMEOUT)."""


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

    @classmethod
    def running(cls) -> Zygote | None:
        """This interpreter's zygote if it runs, else None: what ends processes never starts
        a zygote (the processes of one that ended died with it)."""
        instance = cls._instance
        return instance if instance is not None and instance.alive() else None

    @classmethod
    def adopt(cls, sock: socket.socket, pid: int) -> None:
        """In a loader service: talk to the zygote that forked it, over the socket it was
        given, so its decode processes are forked there too."""
        with cls._instance_lock:
            cls._instance = cls(Channel(sock), pid)

    def __init__(self, channel: Channel | None = None, parent: int | None = None) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._learned: set[str] = set()
        self._numbers = itertools.count(1)
        self._process: subprocess.Popen[bytes] | None = None
        self._parent = parent
        """The zygote's pid when it is this process's parent (in a loader service)."""
        if channel is not None:
            self._channel = channel
            channel.socket.settimeout(REPLY_TIMEOUT)
            return
        ours, theirs = socket.socketpair()
        package_parent = str(Path(__file__).resolve().parents[2])
        environment = dict(os.environ)
        environment["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_parent, environment.get("PYTHONPATH")) if p
        )
        with theirs, _starting:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "aioloader._processes.zygote_main",
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
        # reaped as soon as it ends: a zombie is still a child to whoever waits for this
        # process's children to go (a Jupyter kernel's shutdown waited 30 s for it)
        threading.Thread(target=self._process.wait, name="aioloader-zygote-reap",
                         daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else self._parent or 0

    def alive(self) -> bool:
        if self.foreign:
            return False
        if self._process is not None:
            return self._process.poll() is None
        return os.getppid() == self._parent

    def _request(self, kind: str, argument: Any, fds: Sequence[int] = ()) -> Any:
        """Send a request and wait for its own reply; replies to earlier requests that timed
        out are read and dropped on the way. The wait for the lock is bounded too: a thread
        stuck behind another request names the request it could not send."""
        if not self._lock.acquire(timeout=LOCK_TIMEOUT):
            raise LoaderError(
                f"a {kind} request to the process that starts decode processes (pid {self.pid}) "
                f"waited {LOCK_TIMEOUT:g} s for the requests before it"
            )
        try:
            number = next(self._numbers)
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
        finally:
            self._lock.release()

    def spawn(self, channel: socket.socket) -> int:
        """Fork a decode process that serves `channel`; its pid. Packages decode processes
        were seen to import are imported by the zygote first, once, so that later decode
        processes start with them (a pass that imports torch pays for it once, not per pass)."""
        with self._lock:
            preload, self._learned = sorted(self._learned), set()
        pid: int = self._request("spawn", preload, [channel.fileno()])
        return pid

    def spawn_service(self, channel: socket.socket, packages: list[str]) -> int:
        """Fork a loader service that serves `channel`, after importing `packages`; its pid.
        It dies with the zygote, which is this process's."""
        pid: int = self._request("service", packages, [channel.fileno()])
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


_starting = threading.RLock()
"""Held while the zygote is being started: a fork elsewhere in this process (a
multiprocessing worker, DataLoader's) waits for it. A child forked while `Popen` runs would keep
its pipe open and hang `Popen`, and with it every decode process of this interpreter."""


def _forget_in_child() -> None:
    """A forked copy of the parent must not talk on the parent's control socket: it lets go of
    its copy of the socket (the parent's end stays open) and starts a zygote of its own if it
    needs one."""
    global _starting
    _starting = threading.RLock()
    inherited = Zygote._instance
    Zygote._instance = None
    Zygote._instance_lock = threading.Lock()
    if inherited is not None:
        inherited._channel.close()


os.register_at_fork(before=lambda: _starting.acquire(), after_in_parent=lambda: _starting.release(),
                    after_in_child=_forget_in_child)
