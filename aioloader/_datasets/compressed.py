"""Files that may be compressed (gzip, bzip2, xz), read as their decompressed content: scanned
once from their first byte to index them, then taken in ranges in order. A compressed file has
no ranges to read, so a range of its content comes from one pass over it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from .._tar import compression_of, inflated
from ..storage import _storage as storage


class Scan:
    """A file's content from its chunks, decompressed if its first bytes name a compression;
    how long the content read was."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], url: str,
                 error: type[Exception]) -> None:
        self._chunks, self._url, self._error = chunks, url, error
        self.compression: str | None = None
        self.length = 0

    async def content(self) -> AsyncGenerator[bytes, None]:
        async with aclosing(self._chunks):
            first = await anext(self._chunks, b"")
            self.compression = compression_of(first)
            content = self._then(first)
            if self.compression is not None:
                content = inflated(content, self._url, self.compression, self._error)
            async with aclosing(content):
                async for chunk in content:
                    self.length += len(chunk)
                    yield chunk

    async def _then(self, first: bytes) -> AsyncGenerator[bytes, None]:
        yield first
        async for chunk in self._chunks:
            yield chunk


class Unpacked:
    """A compressed file, decompressed from its first byte and taken in ranges in order: a
    rank reads its pieces of a file in order, so one pass over the file serves them all (a
    range before where it stands starts a new pass). Kept in an iteration's memo, and closed
    with it."""

    def __init__(self, reads: storage.Storage, url: str, compression: str,
                 error: type[Exception]) -> None:
        self._source = reads.stream(url)
        self._content = inflated(self._source, url, compression, error)
        self.position = 0
        self._left = b""

    @classmethod
    async def at(cls, memo: dict[Any, Any], unit: int, start: int, reads: storage.Storage,
                 url: str, compression: str, error: type[Exception]) -> Unpacked:
        """The memo's pass over `unit`, or a new one if that stands past `start`."""
        found: Unpacked | None = memo.get(unit)
        if found is None or found.position > start:
            if found is not None:
                await found.aclose()
            found = memo[unit] = cls(reads, url, compression, error)
        return found

    async def _next(self) -> bytes:
        chunk, self._left = self._left or await anext(self._content, b""), b""
        return chunk

    async def take(self, start: int, end: int) -> AsyncGenerator[bytes, None]:
        """The content's bytes from `start` to `end` (or its end), what comes before passed
        over."""
        while self.position < end:
            chunk = await self._next()
            if not chunk:
                return
            skipped = min(len(chunk), max(0, start - self.position))
            used = min(len(chunk) - skipped, end - self.position - skipped)
            self._left = chunk[skipped + used :]
            self.position += skipped + used
            if used:
                yield chunk[skipped : skipped + used]

    async def aclose(self) -> None:
        await self._content.aclose()
        await self._source.aclose()


@contextlib.asynccontextmanager
async def content_range(reads: storage.Storage, memo: dict[Any, Any], unit: int, url: str,
                        compression: str | None, start: int, end: int, error: type[Exception]
                        ) -> AsyncIterator[AsyncGenerator[bytes, None]]:
    """Bytes `start` to `end` of a file's content: one ranged read of a plain file; of a
    compressed one, taken from the iteration's pass over it (`memo`), one take at a time."""
    if compression is None:
        yield reads.stream(url, start, end)
        return
    async with memo.setdefault(("lock", unit), asyncio.Lock()):
        unpacked = await Unpacked.at(memo, unit, start, reads, url, compression, error)
        yield unpacked.take(start, end)
