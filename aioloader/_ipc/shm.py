"""The one shared-memory layer: segments in /dev/shm created with their space reserved,
attached only when they are this user's own, unlinked, and named so that the zygote can remove
what a dead process left behind.

Reserving the space (`posix_fallocate`) at creation is what keeps a full /dev/shm from killing a
process with SIGBUS on its first write: the caller gets `NoSpace` instead and can fall back.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import sys

SHM_DIR = "/dev/shm"


class NoSpace(Exception):
    """/dev/shm cannot hold a segment of the size asked for."""

    def __init__(self, needed: int) -> None:
        self.needed = needed
        self.free = free_bytes()
        super().__init__(
            f"/dev/shm has {self.free / 2**20:.0f} MiB free, {needed / 2**20:.1f} MiB were needed"
        )


class NotOwned(PermissionError):
    """A segment with an expected name exists but is not this user's private file."""


def available() -> bool:
    return sys.platform == "linux" and os.path.isdir(SHM_DIR)


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def prefix(pid: int | None = None) -> str:
    """Names of segments owned by process `pid` (default: this one) start with this; the
    zygote removes them when that process dies."""
    return f"aioloader-{os.getpid() if pid is None else pid}-"


def new_name(kind: str) -> str:
    """A fresh, unguessable name for a segment of this process."""
    return f"{prefix()}{kind}-{os.urandom(6).hex()}"  # secrets' token_hex, without its 7 ms import


def free_bytes() -> int:
    status = os.statvfs(SHM_DIR)
    return status.f_bavail * status.f_frsize


def reserve(descriptor: int, offset: int, length: int) -> None:
    """Allocate the pages of a byte range now, so later writes cannot hit a full /dev/shm."""
    try:
        os.posix_fallocate(descriptor, offset, length)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise NoSpace(length) from None
        raise


def create(name: str, size: int, reserved: bool = True, populate: bool = False) -> mmap.mmap:
    """A new segment of `size` bytes, mode 0600; with `reserved`, its pages are allocated now
    (NoSpace if they do not fit), else it is sparse and the caller reserves ranges itself.
    `populate`: see `attach`."""
    descriptor = os.open(path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        if reserved:
            reserve(descriptor, 0, size)
        else:
            os.ftruncate(descriptor, size)
        return _map(descriptor, size, populate)
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(descriptor)


def open_owned(name: str) -> int:
    """A read-write descriptor of an existing segment, after checking that it is a regular
    file of this user that nobody else may read or write (NotOwned otherwise)."""
    try:
        descriptor = os.open(path(name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        refuse_foreign(name)  # a symlink or another user's file: say so, not ELOOP or EACCES
        raise
    try:
        check_owned(descriptor, name)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def check_owned(descriptor: int, name: str) -> None:
    _check(os.fstat(descriptor), name)


def refuse_foreign(name: str) -> None:
    """NotOwned if a segment `name` exists and is not this user's private file; looked at
    without opening it or following a link."""
    try:
        info = os.lstat(path(name))
    except FileNotFoundError:
        return
    _check(info, name)


def _check(info: os.stat_result, name: str) -> None:
    if info.st_uid != os.geteuid():
        raise NotOwned(
            f"{path(name)} belongs to another user (uid {info.st_uid}; this process is uid "
            f"{os.geteuid()}): refusing to use it, since whoever made it would choose what this "
            "process reads. Have its owner or root remove it, or choose another name."
        )
    if not stat.S_ISREG(info.st_mode) or info.st_mode & 0o077:
        raise NotOwned(
            f"{path(name)} is not a private file ({stat.filemode(info.st_mode)}): refusing to "
            "use it; only a regular file of mode 0600 is used. Remove it, or choose another name."
        )


def attach(name: str, populate: bool = False) -> mmap.mmap:
    """Map an existing segment of this user's. `populate` maps every page now, in one call:
    for a segment about to be written whole and mapped only briefly, that costs less than a
    page fault per page (never for a sparse segment, whose holes it would fill)."""
    descriptor = open_owned(name)
    try:
        return _map(descriptor, 0, populate)
    finally:
        os.close(descriptor)


def _map(descriptor: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(descriptor, size, flags=flags)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path(name))


def sweep_dead() -> list[int]:
    """Unlink the segments of this user's processes that are gone: a job killed whole (its
    zygote with it: `kill -9` of the group, the OOM killer, a reboot's leftovers on a
    persistent /dev/shm) had nobody left to remove them. The pids swept."""
    if not os.path.isdir(SHM_DIR):
        return []
    uid, swept = os.getuid(), []
    owned: dict[int, list[str]] = {}
    for name in os.listdir(SHM_DIR):
        parts = name.split("-", 2)
        if len(parts) == 3 and parts[0] == "aioloader" and parts[1].isdigit():
            owned.setdefault(int(parts[1]), []).append(name)
    for pid, names in sorted(owned.items()):
        if not _gone(pid):
            continue  # alive (or a pid reused since: left alone, as the owner may be alive)
        with contextlib.suppress(FileNotFoundError):
            if all(os.stat(os.path.join(SHM_DIR, n)).st_uid == uid for n in names):
                for name in names:
                    unlink(name)
                swept.append(pid)
    return swept


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended: no such process, or a zombie (an orphan of a killed
    job waits for init to reap it, which may take a while)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's: alive
    try:
        with open(f"/proc/{pid}/stat") as status:
            return status.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def remove_leftovers(pid: int) -> int:
    """Unlink every segment process `pid` owned; how many there were."""
    if not os.path.isdir(SHM_DIR):
        return 0
    names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix(pid))]
    for name in names:
        unlink(name)
    return len(names)
