"""Context-manager halves shared by everything that owns something to close, and the record of
which process owns it."""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T", bound="Closing")
A = TypeVar("A", bound="AsyncClosing")


class Closing:
    """`with obj:` calls `obj.close()` on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClosing:
    """`async with obj:` awaits `obj.aclose()` on the way out."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class ProcessBound:
    """Remembers the process that made it.

    A child made by `os.fork()` gets a copy of the object, but none of the threads behind it,
    and the processes, sockets and shared memory the copy names are still the parent's; the
    child's finalizers run on its `sys.exit`. So where `foreign` is True, closing only lets go
    of the child's copies: it never stops a process, shuts a socket down, closes a block or
    takes a lock (a thread of the parent may have held it at the fork).
    """

    def __init__(self) -> None:
        self.owner_pid = os.getpid()

    @property
    def foreign(self) -> bool:
        """True in a forked child: what this object names belongs to process `owner_pid`."""
        return os.getpid() != self.owner_pid
