"""The one shared-memory layer.

Blocks (a batch's arrays, an unnamed cache) are memory files with no name anywhere
(`memfd_create`): the process that makes one holds its descriptor, and the others reach it as
`/proc/PID/fd/N`, which the kernel lets only the same user open. The memory goes when the
maker closes the descriptor and the last mapping is gone, so a job killed whole, by any signal,
leaves nothing behind (PyTorch's `file_descriptor` strategy, without sending descriptors).

Named segments in /dev/shm remain only for what must be found by name: a named `SharedCache`
shared by the training processes of a machine. They are attached only when they are this
user's own.

Reserving the space (`posix_fallocate`) at creation is what keeps a full /dev/shm, or a memory
limit, from killing a process with SIGBUS on its first write: the caller gets `NoSpace`
instead and can fall back.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import sys

SHM_DIR = "/dev/shm"
BLOCK_NAME = "aioloader-block"
"""What a block's descriptor shows in /proc/PID/fd and /proc/PID/maps (`/memfd:` first)."""


class NoSpace(Exception):
    """Shared memory (/dev/shm, or the memory a limit leaves) cannot hold the size asked for."""

    def __init__(self, needed: int) -> None:
        self.needed = needed
        super().__init__(f"no room for {needed / 2**20:.1f} MiB more of shared memory")


class NotOwned(PermissionError):
    """A segment with an expected name exists but is not this user's private file."""


def available() -> bool:
    return sys.platform == "linux" and os.path.isdir(SHM_DIR)


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


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


def create(name: str, size: int, reserved: bool = True) -> None:
    """A new segment of `size` bytes, mode 0600 (a named cache's, mapped through
    `open_owned`); with `reserved`, its pages are allocated now (NoSpace if they do not fit),
    else it is sparse and the caller reserves ranges itself."""
    descriptor = os.open(path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        if reserved:
            reserve(descriptor, 0, size)
        else:
            os.ftruncate(descriptor, size)
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


def _map(descriptor: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(descriptor, size, flags=flags)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path(name))


# -- blocks: memory by descriptor ---------------------------------------------------------------
# A block is named by a token, "PID:FD:INODE": the process holding it, its descriptor there, and
# the file's inode, checked on opening so that a descriptor number used again for another file
# is never taken for the block.


def new_block() -> tuple[str, int]:
    """A fresh, empty block of this process's: its token and the descriptor to hold it by (the
    block lives while this descriptor is open, or while anyone maps it)."""
    descriptor = os.memfd_create(BLOCK_NAME, os.MFD_CLOEXEC)
    return token_of(descriptor), descriptor


def token_of(descriptor: int) -> str:
    """How another process of this user opens this process's `descriptor` (`open_block`)."""
    return f"{os.getpid()}:{descriptor}:{os.fstat(descriptor).st_ino}"


def open_block(token: str) -> int:
    """A read-write descriptor of the block `token` names; FileNotFoundError if its maker has
    let go of it (or ended), NotOwned if it is not this user's."""
    pid, number, inode = (int(part) for part in token.split(":"))
    try:
        descriptor = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"shared block {token} is gone: its process let go of it"
                                ) from None
    info = os.fstat(descriptor)
    if info.st_ino != inode or info.st_uid != os.geteuid():
        os.close(descriptor)
        if info.st_ino != inode:
            raise FileNotFoundError(f"shared block {token} is gone: its descriptor was reused")
        raise NotOwned(f"shared block {token} belongs to uid {info.st_uid}: refusing to use it")
    return descriptor


def fill(token: str, size: int, populate: bool = False) -> mmap.mmap:
    """Give a fresh block its `size` bytes, reserved now (NoSpace if they do not fit), and map
    it. Whatever an earlier writer left (a process that died writing it) is dropped first."""
    descriptor = open_block(token)
    try:
        os.ftruncate(descriptor, 0)
        reserve(descriptor, 0, size)
        return _map(descriptor, size, populate)
    finally:
        os.close(descriptor)


def empty(token: str) -> None:
    """Give a fresh block's memory back, so it is fresh again for whoever is lent it next."""
    descriptor = open_block(token)
    try:
        os.ftruncate(descriptor, 0)
    finally:
        os.close(descriptor)


def attach_block(token: str, populate: bool = False) -> mmap.mmap:
    """Map a block another process (or this one) holds. `populate` maps every page now, in
    one call: for a block about to be written whole and mapped only briefly, that costs less
    than a page fault per page."""
    descriptor = open_block(token)
    try:
        return _map(descriptor, 0, populate)
    finally:
        os.close(descriptor)
