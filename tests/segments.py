"""The loader's shared memory as the kernel sees it. Its blocks have no name in /dev/shm: they
are found where processes hold them (/proc/PID/fd) and where they map them (/proc/PID/maps)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from aioloader._ipc import shm

MEMFD = "/memfd:" + shm.BLOCK_NAME


def _pids(pids: Iterable[int] | None) -> list[int]:
    if pids is not None:
        return list(pids)
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def held(pids: Iterable[int] | None = None) -> dict[int, int]:
    """Bytes of each block (by inode) that a descriptor of these processes holds (of every
    process this user may look into, when None)."""
    found: dict[int, int] = {}
    for pid in _pids(pids):
        try:
            numbers = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for number in numbers:
            link = f"/proc/{pid}/fd/{number}"
            try:
                if os.readlink(link).startswith(MEMFD):
                    info = os.stat(link)
                    found[info.st_ino] = info.st_size
            except OSError:
                continue
    return found


def mapped(pids: Iterable[int] | None = None) -> dict[int, int]:
    """Bytes of each block (by inode) these processes map; a block mapped by several counts
    once, as its memory does."""
    found: dict[int, int] = {}
    for pid in _pids(pids):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                lines = maps.readlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(MEMFD):
                start, end = (int(n, 16) for n in fields[0].split("-"))
                inode = int(fields[4])
                found[inode] = max(found.get(inode, 0), end - start)
    return found


def blocks(pids: Iterable[int] | None = None) -> dict[int, int]:
    """Bytes of each block these processes hold or map: the memory their blocks keep."""
    return {**mapped(pids), **held(pids)}


def is_held(token: str) -> bool:
    """Whether the process that made the block `token` names still holds it."""
    pid, number, inode = (int(part) for part in token.split(":"))
    try:
        return os.stat(f"/proc/{pid}/fd/{number}").st_ino == inode
    except OSError:
        return False


def names() -> list[str]:
    """aioloader's names in /dev/shm: only a named cache's, while one is attached."""
    if not os.path.isdir(shm.SHM_DIR):
        return []
    return sorted(name for name in os.listdir(shm.SHM_DIR) if name.startswith("aioloader-"))
