"""`python -m aioloader._runtime.zygote_main`: the zygote, a small process per interpreter that
forks decode processes and cleans up after its parent (`zygote.Zygote` starts it and talks to
it).

It has imported aioloader, numpy, cloudpickle and the decode code (`serve`) but never the user's
main module, so a decode process forked from it starts in milliseconds and runs no user code but
what reaches it by value. Before forking it imports the installed packages decode processes
were seen to use (`preload`).

Requests come on the control socket in `channel.py`'s framing, one at a time: `(number, kind,
argument)`, answered by `(number, answer)`, so the parent can drop a reply that comes after its
request timed out. Kinds: `spawn` (fork a decode process serving the descriptor sent with the
request, after preloading the packages named; answer: its pid), `preload`, `status` (a decode
process's exit status, None while it runs), `watch` / `unwatch` (a named cache the parent is a
member of).

It watches its parent: when the control socket closes or the parent's pid is no longer its
parent (checked every POLL_SECONDS), even after a SIGKILL, it kills the decode processes, which
die with it anyway (PR_SET_PDEATHSIG), removes every shared-memory segment named with the
parent's pid, and removes the watched named caches no live process is attached to.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from .._cache import remove_if_unused
from .channel import Channel
from .preload import preload
from .serve import serve
from .shm import remove_leftovers

POLL_SECONDS = 0.25
"""How often the zygote checks that its parent is alive and reaps its children."""


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
        remove_leftovers(self.parent)
        for name in self.caches:
            remove_if_unused(name)


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)  # runs the clean-up on the way out


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _exit_on_term)
    preload(["PIL.Image"])  # most decode functions decode images; later, what they were seen to use
    with socket.socket(fileno=int(sys.argv[1])) as control:
        _Server(Channel(control), int(sys.argv[2])).serve()


if __name__ == "__main__":
    main()
