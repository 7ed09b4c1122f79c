"""A rank's way to the loader service of its node (`service="node"`): find it, or start it.

Every rank of a job that builds the same Loader meets at one Unix socket, named by the user,
the job and the Loader's fingerprint, in a directory only that user may enter (0700; the
service also checks each peer's uid). The first rank to find no service starts one, under a
file lock so that ranks arriving together start only one; the service is a process of its own
session, not a child the starting rank waits for, so any rank may die without taking it along.
It ends when its last rank leaves; a rank that meets it just as it ends starts another.

A rank with another configuration has another fingerprint, so another socket: it gets a
service of its own and its own correct batches, never another configuration's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .._errors import LoaderError
from .messages import Environment
from .service_client import ServiceClient, ServiceInit
from .zygote import START_TIMEOUT

MAX_SOCKET_PATH = 108
"""sun_path's size on Linux, its final NUL included."""
ATTEMPTS = 5
"""Connections tried before giving up: each may meet a service that is just ending."""


def job() -> str:
    """The job, as torchrun names it: its run id and its rendezvous address (the run id alone
    is "none" unless given), else the processes of one parent; and the working directory, so
    jobs that share those but read relative paths elsewhere never meet."""
    variables = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
    named = [os.environ.get(name, "") for name in variables]
    launcher = ":".join(named) if any(named) else f"parent {os.getppid()}"
    return f"{launcher}\0{os.getcwd()}"


def local_ranks() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE), which share its memory limit."""
    with contextlib.suppress(ValueError):
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return 1


def private_directory() -> Path:
    """This user's directory of node sockets: made 0700, refused if anyone else could enter.
    Under XDG_RUNTIME_DIR when it exists (a batch job may inherit one that does not)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime and os.path.isdir(runtime) else tempfile.gettempdir()
    folder = Path(base) / f"aioloader-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = os.lstat(folder)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
            or info.st_mode & 0o077):
        raise LoaderError(
            f"{folder} must be a directory of user {os.getuid()} that no one else may enter "
            f"(mode 0700), but it is mode {stat.filemode(info.st_mode)} of user {info.st_uid}: "
            "remove it, or set XDG_RUNTIME_DIR to a private directory")
    return folder


def connect(code: bytes, fingerprint: str, packages: list[str], stall_timeout: float
            ) -> ServiceClient:
    """A connection to this job's service for the Loader with `fingerprint`, started if
    there is none; `code` is this rank's configuration."""
    name = hashlib.sha256(f"{job()}\0{fingerprint}".encode()).hexdigest()[:32]
    folder = private_directory()
    path = folder / f"{name}.sock"
    if len(os.fsencode(path)) >= MAX_SOCKET_PATH:
        raise LoaderError(f"the node's socket path {path} is longer than a Unix socket's "
                          f"{MAX_SOCKET_PATH - 1} bytes: set XDG_RUNTIME_DIR or TMPDIR to a "
                          "shorter directory")
    init = ServiceInit(code, Environment.here(), fingerprint, tuple(packages))
    last: BaseException | None = None
    for _ in range(ATTEMPTS):
        sock = _connected(path)
        if sock is None:
            with locked(folder / f"{name}.lock"):
                sock = _connected(path) or _start(path)
        client = ServiceClient(sock, 0, stall_timeout, shared=True)
        try:
            client.introduce(init)
            return client
        except (OSError, EOFError) as e:  # met a service as it ended: find or start another
            last = e
    raise LoaderError(f"could not reach the node's loader service at {path}: {last} (what "
                      f"it said is in {path.with_suffix('.log')})")


def _connected(path: Path) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def _start(path: Path) -> socket.socket:
    """Start a service listening at `path` (a stale socket there is replaced), and connect to
    it: the socket listens before the service runs, so the connection waits in its backlog."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listening.bind(str(path))
        listening.listen(64)
        package_root = str(Path(__file__).resolve().parents[2])  # where aioloader is
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(path.with_suffix(".log"), "ab") as log:  # what it says, should it fail
            service = subprocess.Popen(
                [sys.executable, "-m", "aioloader._node_service", str(listening.fileno()),
                 str(path)],
                pass_fds=[listening.fileno()], start_new_session=True, env=environment,
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/")
        threading.Thread(target=service.wait, name="aioloader-node-reap", daemon=True).start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        return sock
    finally:
        listening.close()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path`, waiting at most START_TIMEOUT for it."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LoaderError(f"{path} stayed locked for {START_TIMEOUT:g} s: another "
                                      "rank is starting the node's loader service") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(descriptor)
