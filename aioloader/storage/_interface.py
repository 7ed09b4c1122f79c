"""What every store is: the interface `Storage` reads through, and what it makes one with.

A new store is one module with a class that has the methods of `Store`, and one line in
`_registry.SCHEMES`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ._counters import StorageCounters
from ._limits import DEFAULT_MAX_OBJECT_BYTES
from ._retry import RetryPolicy
from ._version import Version


@dataclass(frozen=True)
class StoreSettings:
    """What every store of one `Storage` is made with."""

    policy: RetryPolicy
    counters: StorageCounters
    concurrency: int = 64
    """Reads in flight."""
    connections: int = 64
    """Connections a pool may open: the reads in flight and their hedges."""
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES


@dataclass
class Resumed:
    """One stream across its tries: the version of the object its first answer gave, which
    every later try (a resume) must still find."""

    began: Version | None = None


class Versioned(NamedTuple):
    """Bytes of an object and the version of it they came from, as the answer labelled it."""

    data: bytes
    version: Version


class Store(Protocol):
    """Reads of the URLs of one or more schemes. Made by `Storage`, one per class, on the
    first read of one of its URLs; `list` needs no instance. Each call is one try: a store
    maps its client's errors, at one boundary, into `Retryable` (another try may mend it) or
    FetchError (final), and `Storage` retries."""

    def __init__(self, settings: StoreSettings) -> None: ...

    async def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """The whole object, or bytes `start` up to `end` (FetchError naming the URL)."""
        ...

    async def read_versioned(self, url: str, start: int | None = None, end: int | None = None,
                             unless: Version | None = None) -> Versioned | None:
        """As `read`, with the object's version; None when the object is still `unless` (a
        conditional request answered 304, without a body). An `unless` without ETag or
        Last-Modified cannot be asked about: the bytes are read."""
        ...

    async def size(self, url: str) -> int: ...

    def stream(self, url: str, start: int, end: int | None, chunk_size: int, resumed: Resumed
               ) -> AsyncGenerator[bytes, None]:
        """Bytes `start` to `end` (or the object's end) in chunks. The first try sets
        `resumed.began`; a later one (a resume after a break) fails when the object is no
        longer that version."""
        ...

    @classmethod
    def list(cls, prefix: str) -> list[str]:
        """URLs of every object under `prefix` (by whole path segments: `data/train` holds
        `data/train/0.jpg`, not `data/train-0.jpg`), in order."""
        ...

    async def aclose(self) -> None: ...
