"""`python -m aioloader._processes.zygote_main`: the zygote, a small process per interpreter that
forks decode processes and cleans up after its parent (`zygote.Zygote` starts it and talks to
it).

It has imported aioloader, numpy, cloudpickle and the decode code (`serve`) but never the user's
main module, so a decode process forked from it starts in milliseconds and runs no user code but
what reaches it by value. Before forking it imports the installed packages decode processes
were seen to use (`preload`).

Requests come on the control socket in `channel.py`'s framing, one at a time: `(number, kind,
argument)`, answered by `(number, answer)`, so the parent can drop a reply that comes after its
request timed out. Kinds: `spawn` (fork a decode process serving the descriptor sent with the
request, after preloading the packages named; answer: its pid), `service` (fork a loader
service the same way, with a control socket of its own to the zygote), `preload`, `status` (a
child's exit status, None while it runs), `watch` / `unwatch` (a named cache the client is a
member of). Each loader service is a client like the parent: its decode processes, segments and
caches are cleaned up when it ends.

It watches its parent: when the control socket closes or the parent's pid is no longer its
parent (checked every POLL_SECONDS), even after a SIGKILL, it kills the decode processes, which
die with it anyway (PR_SET_PDEATHSIG), removes every shared-memory segment named with the
parent's pid, and removes the watched named caches no live process is attached to.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._cache import remove_if_unused
from .._ipc.channel import Channel
from .._worker.preload import preload
from .._worker.serve import serve

POLL_SECONDS = 0.25
"""How often the zygote checks that its parent is alive and reaps its children."""


DECODE_NAME = b"aioloader-dec"
SERVICE_NAME = b"aioloader-svc"
SERVICE_MODULE = "aioloader._service.server"
"""Started by name, as the node's service is: this layer imports nothing of the service's."""
"""What `ps -o comm` and `top` show for a decode process and a loader service."""


def die_with_parent(name: bytes) -> None:
    """Ask the kernel to SIGKILL this process when its parent (the zygote) dies; name it."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME


@dataclass
class _Client:
    """A process the zygote works for: the training process that started it, or a loader
    service it forked, which asks for decode processes of its own."""

    channel: Channel
    pid: int
    children: set[int] = field(default_factory=set)
    """The processes forked at its request (a loader service is its client's child)."""
    caches: set[str] = field(default_factory=set)


class _Server:
    def __init__(self, control: Channel, parent: int) -> None:
        self.parent = _Client(control, parent)
        self.clients = {control.socket.fileno(): self.parent}
        self.statuses: dict[int, int] = {}

    def serve(self) -> None:
        try:
            self.parent.channel.send("ready")  # the parent may have exited already
            while os.getppid() == self.parent.pid:
                sockets = [client.channel.socket for client in self.clients.values()]
                readable, _, _ = select.select(sockets, [], [], POLL_SECONDS)
                self.reap()
                for sock in readable:
                    self.handle(self.clients[sock.fileno()])
        except (EOFError, OSError):
            pass  # the parent closed its end: it exited or died
        finally:
            self.clean_up()

    def handle(self, client: _Client) -> None:
        """Answer one request; a loader service whose end closed is cleaned up after."""
        try:
            (number, kind, argument), fds = client.channel.receive_with_fds()
            client.channel.send((number, self.answer(client, kind, argument, fds)))
        except (EOFError, OSError):
            if client is self.parent:
                raise
            self.drop(client)

    def answer(self, client: _Client, kind: str, argument: Any, fds: list[int]) -> Any:
        if kind == "spawn":
            preload(argument)
            return self.fork(client, fds[0], serve)
        if kind == "service":
            preload(argument)
            return self.fork_service(client, fds[0])
        if kind == "preload":
            preload(argument)
            return "ok"
        if kind == "status":
            self.reap()
            return self.statuses.get(argument)
        (client.caches.add if kind == "watch" else client.caches.discard)(argument)
        return "ok"

    def fork(self, client: _Client, channel: int, run: Callable[[int], int],
             keep: socket.socket | None = None, name: bytes = DECODE_NAME) -> int:
        """A child named `name` that runs `run(channel)` and dies with the zygote; `keep` is
        the one other socket it keeps."""
        zygote = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for other in self.clients.values():
                    other.channel.close()
                die_with_parent(name)
                if os.getppid() != zygote:  # the zygote died before the request took effect
                    os._exit(1)
                code = run(channel)
                _flush_multiprocessing()
            finally:
                os._exit(code)
        os.close(channel)
        if keep is not None:
            keep.close()
        client.children.add(pid)
        return pid

    def fork_service(self, client: _Client, channel: int) -> int:
        """A loader service for `client`, with a control socket of its own to this zygote
        (decode processes of its own, cleaned up when it ends)."""
        serve = importlib.import_module(SERVICE_MODULE).run

        ours, theirs = socket.socketpair()
        zygote = os.getpid()

        def run(descriptor: int) -> int:
            ours.close()
            code: int = serve(descriptor, theirs.detach(), zygote)
            return code

        pid = self.fork(client, channel, run, keep=theirs, name=SERVICE_NAME)
        self.clients[ours.fileno()] = _Client(Channel(ours), pid)
        return pid

    def reap(self) -> None:
        for client in self.clients.values():
            for pid in list(client.children):
                with contextlib.suppress(ChildProcessError):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        client.children.discard(pid)
                        self.statuses[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(
                            status) else os.WEXITSTATUS(status)

    def drop(self, client: _Client) -> None:
        """A loader service ended: its decode processes, segments and caches go too."""
        self.stop([client])  # reaped while still a client
        del self.clients[client.channel.socket.fileno()]
        client.channel.close()

    def clean_up(self) -> None:
        self.stop(list(self.clients.values()))

    def stop(self, clients: list[_Client]) -> None:
        """Processes first, then the named caches the clients had joined (their last member
        removes one)."""
        for client in clients:
            for pid in client.children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(client.children for client in clients) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)
        for client in clients:
            for name in client.caches:
                remove_if_unused(name)


def _flush_multiprocessing() -> None:
    """What multiprocessing does as its own processes end, in a child that ends by os._exit:
    a queue's items put here are written out by its feeder thread, which this joins (else
    they die with the process, as a DataLoader worker's would not)."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util._exit_function()


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
