"""`Storage`: reads for one event loop, through the right store for each URL.

A loader opens one `Storage` per run and makes it current, so every `fetch` in that run shares
one connection pool; `read` and `read_range` outside a loader open a short-lived one.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from .._closing import AsyncClosing
from ._coalesce import RangeCoalescer
from ._counters import StorageCounters
from ._diskcache import DiskCache
from ._hedge import HEDGE_CONNECTIONS, HEDGE_MAX_BYTES, Hedger
from ._limits import DEFAULT_MAX_OBJECT_BYTES
from ._local import LocalStore
from ._retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT, RetryPolicy
from ._s3 import S3Store, split

if TYPE_CHECKING:
    from ._http import HttpStore

SCHEMES = ("", "file", "http", "https", "s3")
_current: contextvars.ContextVar[Storage | None] = contextvars.ContextVar(
    "aioloader_storage", default=None
)


def check_url(url: str) -> str:
    """Return `url` if some store can read it, else raise a ValueError that says what can, or
    what is wrong with it (see `_s3.split` and `local_path`)."""
    scheme = urlsplit(url).scheme.lower()
    if len(scheme) == 1 and os.name == "nt":  # a Windows drive letter, not a scheme
        scheme = ""
    if scheme not in SCHEMES:
        raise ValueError(
            f"unknown URL scheme {scheme!r} in {url!r}: use a local path, file://, http://, "
            "https:// or s3://"
        )
    if scheme == "s3":
        split(url)
    else:
        local_path(url)
    return url


def local_path(url: str) -> str | None:
    """The file-system path a local URL names, or None for a remote URL. A file:// URL naming
    another host is a ValueError: its path would be read on this one."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc.lower() not in ("", "localhost"):
            raise ValueError(
                f"{url!r} names the host {parts.netloc!r}: file:// reads this machine's files "
                "(file:///path or file://localhost/path); use http(s):// for another host"
            )
        return unquote(parts.path)
    if parts.scheme in ("http", "https", "s3"):
        return None
    return url


class Storage(AsyncClosing):
    """Reads for one event loop: one HTTP session and one file thread pool, closed together."""

    def __init__(
        self,
        concurrency: int = 64,
        retries: int = DEFAULT_RETRIES,
        timeout: float = DEFAULT_TIMEOUT,
        counters: StorageCounters | None = None,
        disk_cache: DiskCache | None = None,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        hedge: bool | Hedger = True,
    ) -> None:
        """`max_object_bytes` bounds what one remote read or stream returns, so a server that
        sends without end (or announces 100 GB) gets a FetchError, not all of the memory.
        `hedge` sends a second request for a remote read slower than most (see `_hedge`); a
        Hedger given here keeps what it learnt of read times from one storage to the next."""
        if max_object_bytes < 1:
            raise ValueError(f"max_object_bytes must be 1 or more, got {max_object_bytes}")
        self.concurrency = concurrency
        """Reads in flight this storage is sized for (streams read that far ahead)."""
        self.counters = counters if counters is not None else StorageCounters()
        self._disk_cache = disk_cache
        self._local = LocalStore(max_threads=min(32, concurrency))
        self._policy = RetryPolicy(retries, timeout)
        self._max_object_bytes = max_object_bytes
        # room beyond the reads in flight for their hedges, which must not queue behind them
        self._connections = concurrency + (HEDGE_CONNECTIONS if hedge is not False else 0)
        self._http: HttpStore | None = None
        self._s3: S3Store | None = None
        self._coalescer = RangeCoalescer(self._read)
        self._hedger = hedge if isinstance(hedge, Hedger) else (
            Hedger(self.counters) if hedge else None)

    def _remote(self, url: str) -> HttpStore | S3Store:
        """The store for a remote URL, S3 or HTTP, made on first use: obstore and aiohttp
        are imported only by a loader that reads through them (aiohttp alone takes 0.15 s,
        on the way to a first batch of local data)."""
        if url[:5].lower() != "s3://":
            if self._http is None:
                from ._http import HttpStore

                self._http = HttpStore(self._connections, self._policy, self.counters,
                                       self._max_object_bytes)
            return self._http
        if self._s3 is None:
            self._s3 = S3Store(self._policy, self.counters, self._max_object_bytes)
        return self._s3

    async def read(self, url: str) -> bytes:
        return await self._read(url, None, None)

    async def read_many(self, urls: list[str]) -> list[bytes]:
        """Whole objects: local files in one trip to a file thread, remote ones concurrently."""
        paths = [local_path(url) for url in urls]
        if all(path is not None for path in paths):
            data = await self._local.read_many([p for p in paths if p is not None])
            self.counters.requests += len(data)
            self.counters.bytes_read += sum(map(len, data))
            return data
        return list(await asyncio.gather(*(self.read(url) for url in urls)))

    async def read_range(self, url: str, start: int, end: int) -> bytes:
        """Bytes `start` up to, not including, `end`; neighbouring ranges read together."""
        if not 0 <= start <= end:
            raise ValueError(f"bad byte range {start}..{end} for {url}")
        return await self._coalescer.read(url, start, end)

    async def size(self, url: str) -> int:
        """The object's size in bytes (a stat, or an HTTP HEAD)."""
        path = local_path(url)
        return await (self._remote(url).size(url) if path is None else self._local.size(path))

    async def stream(
        self, url: str, start: int = 0, end: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncGenerator[bytes, None]:
        """The bytes from `start` to `end` (or the end) in chunks, without holding them all."""
        path = local_path(url)
        chunks = (
            self._remote(url).stream(url, start, end, chunk_size)
            if path is None
            else self._local.stream(path, start, end, chunk_size)
        )
        async for chunk in chunks:
            self.counters.bytes_read += len(chunk)
            yield chunk

    async def _read(self, url: str, start: int | None, end: int | None) -> bytes:
        path = local_path(url)
        if path is None and self._disk_cache is not None:
            data = await self._read_through_disk(self._disk_cache, url, start, end)
        elif path is None:
            data = await self._read_remote(url, start, end)
        else:
            data = await self._local.read(path, start, end)
            self.counters.requests += 1
        self.counters.bytes_read += len(data)
        return data

    async def _read_through_disk(
        self, cache: DiskCache, url: str, start: int | None, end: int | None
    ) -> bytes:
        """Remote bytes from the disk cache, or from the network and then into the cache. The
        cache's SQLite and file work blocks, so it runs on the file threads; it never raises."""
        cached = await self._local.run(cache.get, url, start, end)
        if cached is not None:
            return cached
        data = await self._read_remote(url, start, end)
        await self._local.run(cache.put, url, start, end, data)
        return data

    async def _read_remote(self, url: str, start: int | None, end: int | None) -> bytes:
        store = self._remote(url)
        large = start is not None and end is not None and end - start > HEDGE_MAX_BYTES
        if self._hedger is None or large:  # a large read is bound by bandwidth, not latency
            return await store.read(url, start, end)
        return await self._hedger.read(lambda: store.read(url, start, end))

    @contextmanager
    def as_current(self) -> Iterator[Storage]:
        """Make this the storage that module-level `read` uses in this context."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    async def aclose(self) -> None:
        try:
            await self._coalescer.aclose()
            if self._http is not None:
                await self._http.aclose()
        finally:
            self._local.close()


@asynccontextmanager
async def borrowed() -> AsyncIterator[Storage]:
    """The running loader's storage in this context, or a short-lived one of our own."""
    storage = _current.get()
    if storage is not None:
        yield storage
        return
    async with Storage(concurrency=8) as own:
        with own.as_current():
            yield own


async def read(url: str) -> bytes:
    """All bytes at `url`, through the running loader's storage when there is one."""
    async with borrowed() as storage:
        return await storage.read(url)


async def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes `start` up to, not including, `end` at `url`."""
    async with borrowed() as storage:
        return await storage.read_range(url, start, end)
