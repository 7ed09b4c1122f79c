"""A rank's way to the loader service of its node (`service="node"`): find it, or start it.

Every rank of a job that builds the same Loader meets at one Unix socket, named by the user,
the job and the Loader's fingerprint, in a folder only that user may enter (0700), under a
parent no other user can change. The folder is opened once and reached through its descriptor,
and both ends check the other's uid (SO_PEERCRED) before a byte is sent or unpickled.
The first rank to find no service starts one, under a
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
import logging
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .._errors import LoaderError
from .._ipc.messages import Environment
from .._processes.zygote import START_TIMEOUT
from .client import ServiceClient
from .messages import ServiceInit

FOLDER_NAMES = 8
"""Names tried in one place (`aioloader-UID`, `aioloader-UID-1`, ...) before the next place."""
log = logging.getLogger("aioloader")
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


@dataclass(frozen=True)
class Folder:
    """This user's folder of node sockets, opened once and checked through its descriptor:
    the socket, the lock and the log are reached through `/proc/self/fd`, so a folder renamed
    or swapped after the check is never the one used."""

    descriptor: int
    path: Path
    """Where it was found, for messages; never used to reach it."""

    def entry(self, name: str) -> str:
        return f"/proc/self/fd/{self.descriptor}/{name}"


def private_directory() -> Folder:
    """This user's folder of node sockets, made 0700. Under XDG_RUNTIME_DIR when it is a
    folder only this user (or root) can change, else in the temporary folder. A place another
    user could change, or a name they squat (a folder, a symlink), is passed over for the next
    (`aioloader-UID-1`, ...): every rank of the user walks the same names, so they still meet,
    and a log line says why."""
    uid = os.getuid()
    for base in _bases():
        try:
            parent = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            why = _untrusted(os.fstat(parent), uid)
            if why:
                log.warning("node sockets not under %s: %s", base, why)
                continue
            for attempt in range(FOLDER_NAMES):
                name = f"aioloader-{uid}" + (f"-{attempt}" if attempt else "")
                folder = _own_folder(parent, name, uid)
                if isinstance(folder, int):
                    return Folder(folder, Path(base) / name)
                log.warning("node sockets not in %s: %s", Path(base) / name, folder)
        finally:
            os.close(parent)
    raise LoaderError(f"found no folder for the node's sockets that only user {uid} may "
                      "change: set XDG_RUNTIME_DIR to a private directory")


def _bases() -> list[str]:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    return [base for base in (runtime, tempfile.gettempdir()) if base]


def _untrusted(info: os.stat_result, uid: int) -> str:
    """Why a parent folder is no place for ours ("" if it is): another user could rename or
    swap what lies in it."""
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if info.st_uid not in (uid, 0):
        return f"it belongs to user {info.st_uid}"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"others may write in it (mode {stat.filemode(info.st_mode)}, no sticky bit)"
    return ""


def _own_folder(parent: int, name: str, uid: int) -> int | str:
    """`name` in `parent`, made if missing, opened without following a link: its descriptor
    if it is a folder of `uid` that no one else may enter, else why not."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    try:
        descriptor = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=parent)
    except OSError as e:
        return f"cannot be opened as a folder ({e.strerror})"
    info = os.fstat(descriptor)
    if info.st_uid != uid or info.st_mode & 0o077:
        os.close(descriptor)
        return (f"mode {stat.filemode(info.st_mode)} of user {info.st_uid}, not a folder of "
                f"user {uid} that no one else may enter")
    return descriptor


def peer_uid(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", credentials)
    return pid, uid


def connect(code: bytes, fingerprint: str, packages: list[str], stall_timeout: float
            ) -> ServiceClient:
    """A connection to this job's service for the Loader with `fingerprint`, started if
    there is none; `code` is this rank's configuration."""
    name = socket_name(fingerprint)
    folder = private_directory()
    try:
        sweep(folder)
        path = folder.entry(f"{name}.sock")
        init = ServiceInit(code, Environment.here(), fingerprint, tuple(packages))
        last: BaseException | None = None
        for _ in range(ATTEMPTS):
            sock = _connected(path)
            if sock is None:
                with locked(folder.entry(f"{name}.lock")):
                    sock = _connected(path) or _start(folder, name)
            client = ServiceClient(sock, 0, stall_timeout, shared=True)
            try:
                client.introduce(init)
                return client
            except (OSError, EOFError) as e:  # met a service as it ended: find or start another
                last = e
    finally:
        os.close(folder.descriptor)
    raise LoaderError(f"could not reach the node's loader service at {folder.path / name}.sock: "
                      f"{last} (what it said is in {folder.path / name}.log)")


def socket_name(fingerprint: str) -> str:
    """The service's name in the folder: the job's and the Loader's."""
    return hashlib.sha256(f"{job()}\0{fingerprint}".encode()).hexdigest()[:32]


def _connected(path: str) -> socket.socket | None:
    """A connection to the service at `path`, checked before anything is sent or received:
    a listener of another user is refused."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        pid, uid = peer_uid(sock)
        if uid != os.getuid():
            raise LoaderError(f"the node's loader service socket is held by process {pid} of "
                              f"user {uid}, not of user {os.getuid()}: refused, nothing sent")
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


def _start(folder: Folder, name: str) -> socket.socket:
    """Start a service listening at `name` in `folder` (a stale socket there is replaced),
    and connect to it: the socket listens before the service runs, so the connection waits
    in its backlog. The service gets the folder's descriptor, and reaches it as we do."""
    path = folder.entry(f"{name}.sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listening.bind(path)
        listening.listen(64)
        package_root = str(Path(__file__).resolve().parents[2])  # where aioloader is
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        log_file = os.open(folder.entry(f"{name}.log"),
                           os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        with open(log_file, "ab") as log_output:  # what it says, should it fail
            service = subprocess.Popen(
                [sys.executable, "-m", "aioloader._service.node_server", str(listening.fileno()),
                 path],
                pass_fds=[listening.fileno(), folder.descriptor], start_new_session=True,
                env=environment, stdin=subprocess.DEVNULL, stdout=log_output, stderr=log_output,
                cwd="/")
        threading.Thread(target=service.wait, name="aioloader-node-reap", daemon=True).start()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return sock
    finally:
        listening.close()


@contextlib.contextmanager
def locked(path: str | Path, wait: float = START_TIMEOUT) -> Iterator[None]:
    """Hold an exclusive lock on `path`, waiting at most `wait` seconds for it (BlockingIOError
    past that when `wait` is 0, else LoaderError). Its holder may remove the file: a lock
    taken on a file that was removed or replaced meanwhile is taken again on the new one."""
    deadline = time.monotonic() + wait
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not wait:
                        raise
                    if time.monotonic() > deadline:
                        raise LoaderError(
                            f"{path} stayed locked for {wait:g} s: another rank is starting "
                            "the node's loader service") from None
                    time.sleep(0.02)
            try:
                same = os.stat(path).st_ino == os.fstat(descriptor).st_ino
            except FileNotFoundError:
                same = False  # removed by its holder meanwhile
            if same:
                yield
                return
        finally:
            os.close(descriptor)


def sweep(folder: Folder) -> None:
    """Remove what ended services left in the folder: sockets nothing listens on (a service
    killed with SIGKILL), their locks, and logs that say nothing. A log that says something
    stays: it tells why a service failed. A name being started now is locked: left alone."""
    live = _listening_names()
    for stem in sorted({entry.rpartition(".")[0] for entry in os.listdir(folder.entry(""))
                        if entry.endswith((".sock", ".lock", ".log"))}):
        if f"{stem}.sock" in live:
            continue
        with contextlib.suppress(OSError), locked(folder.entry(f"{stem}.lock"), wait=0):
            if f"{stem}.sock" not in _listening_names():  # not started just before
                remove_ended(folder.entry(f"{stem}.sock"))


def remove_ended(socket_path: str) -> None:
    """A service's socket, its empty log and its lock (held by the caller) go."""
    base = socket_path.removesuffix(".sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    with contextlib.suppress(OSError):
        if os.stat(f"{base}.log").st_size == 0:
            os.unlink(f"{base}.log")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{base}.lock")


def _listening_names() -> set[str]:
    """The names of the Unix sockets something listens on now, from the kernel's table
    (`__SO_ACCEPTCON`): no connection is made, so no service sees a visitor."""
    names = set()
    with open("/proc/net/unix") as table:
        next(table, None)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and int(fields[3], 16) & 0x10000:
                names.add(fields[7].rpartition("/")[2])
    return names
