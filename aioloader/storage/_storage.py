"""`Storage`: reads for one event loop, through the right store for each URL.

A loader opens one `Storage` per run and makes it current, so every `fetch` in that run shares
one connection pool; `read` and `read_range` outside a loader open a short-lived one.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager
from typing import Any, TypeVar

from .._closing import AsyncClosing
from ._coalesce import RangeCoalescer
from ._counters import StorageCounters
from ._diskcache import DiskCache
from ._hedge import HEDGE_CONNECTIONS, HEDGE_MAX_BYTES, Hedger
from ._interface import Resumed, Store, StoreSettings
from ._limits import DEFAULT_MAX_OBJECT_BYTES
from ._local import LocalStore, local_path
from ._registry import check_url, store_class
from ._retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT, Attempts, Retryable, RetryPolicy

__all__ = ["Storage", "borrowed", "check_url", "list_prefix", "local_path", "read", "read_range"]

T = TypeVar("T")

_current: contextvars.ContextVar[Storage | None] = contextvars.ContextVar(
    "aioloader_storage", default=None
)


class Storage(AsyncClosing):
    """Reads for one event loop, each through the store of its URL's scheme (`_registry`): one
    file thread pool, and each remote store made on first use; closed together."""

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
        self._settings = StoreSettings(
            RetryPolicy(retries, timeout), self.counters, concurrency,
            # room beyond the reads in flight for their hedges, which must not queue behind them
            concurrency + (HEDGE_CONNECTIONS if hedge is not False else 0), max_object_bytes)
        self._local = LocalStore(self._settings)
        self._stores: dict[type[Store], Store] = {LocalStore: self._local}
        self._coalescer = RangeCoalescer(self._read)
        self._hedger = hedge if isinstance(hedge, Hedger) else (
            Hedger(self.counters) if hedge else None)

    @property
    def max_object_bytes(self) -> int:
        return self._settings.max_object_bytes

    @property
    def caches_on_disk(self) -> bool:
        """Remote reads go through a disk cache (`read` only: a stream bypasses it)."""
        return self._disk_cache is not None

    def _store(self, url: str) -> Store:
        """The store for the URL, made on first use."""
        kind = store_class(url)
        store = self._stores.get(kind)
        if store is None:
            store = self._stores[kind] = kind(self._settings)
        return store

    async def read(self, url: str) -> bytes:
        return await self._read(url, None, None)

    async def read_many(self, urls: list[str]) -> list[bytes]:
        """Whole objects: local files in one trip to a file thread, remote ones concurrently."""
        paths = [local_path(url) for url in urls]
        if all(path is not None for path in paths):  # one trip to a file thread
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
        """The object's size in bytes (a stat, or a HEAD)."""
        store = self._store(url)
        return await self._retried(url, lambda: store.size(url))

    async def stream(
        self, url: str, start: int = 0, end: int | None = None, chunk_size: int = 1 << 20
    ) -> AsyncGenerator[bytes, None]:
        """The bytes from `start` to `end` (or the end) in chunks, without holding them all.
        A break resumes where it stopped, in the same object; the retry budget counts failures
        in a row, so a long stream survives many blips."""
        store, attempts, resumed = self._store(url), self._attempts(url), Resumed()
        position = start
        while end is None or position < end:
            try:
                body = store.stream(url, position, end, chunk_size, resumed)
                async with aclosing(body):
                    async for chunk in body:
                        position += len(chunk)
                        attempts.reset()
                        self.counters.bytes_read += len(chunk)
                        yield chunk
                if end is None or position >= end:
                    return
                raise Retryable(f"the body ended at byte {position} of {end}")
            except Retryable as fault:
                await attempts.failed(fault)

    def _attempts(self, url: str) -> Attempts:
        return Attempts(url, self._settings.policy, self.counters)

    async def _retried(self, url: str, attempt: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The only retry loop: tries `attempt` until it gives an answer, raises what is final,
        or the budget is spent."""
        attempts = self._attempts(url)
        while True:
            try:
                return await attempt()
            except Retryable as fault:
                await attempts.failed(fault)

    async def _read(self, url: str, start: int | None, end: int | None) -> bytes:
        store = self._store(url)
        if store is self._local:
            data = await store.read(url, start, end)
            self.counters.requests += 1
        elif self._disk_cache is not None:
            data = await self._read_through_disk(self._disk_cache, store, url, start, end)
        else:
            data = await self._read_remote(store, url, start, end)
        self.counters.bytes_read += len(data)
        return data

    async def _read_through_disk(
        self, cache: DiskCache, store: Store, url: str, start: int | None, end: int | None
    ) -> bytes:
        """Remote bytes from the disk cache, or from the network and then into the cache.

        An entry whose version of the object this job has seen is served as it is (epoch 2
        asks nothing); any other is asked about first, If-None-Match its ETag (else
        If-Modified-Since): a 304 costs a round trip without a body, a 200 brings the new
        bytes. An entry without either is read again. The cache's SQLite and file work
        blocks, so it runs on the file threads; it never raises."""
        entry = await self._local.run(cache.get, url, start, end)
        if entry is not None and entry.trusted:
            return entry.data
        unless = None if entry is None else entry.version
        answer = await self._hedged(
            url, lambda: store.read_versioned(url, start, end, unless), start, end)
        if answer is None:  # a 304, to a question only an entry's version asks
            assert entry is not None and unless is not None
            cache.checked_unchanged(url, unless)
            return entry.data
        await self._local.run(cache.put, url, start, end, answer.data, answer.version,
                              entry is not None)
        return answer.data

    async def _read_remote(self, store: Store, url: str, start: int | None, end: int | None
                           ) -> bytes:
        return await self._hedged(url, lambda: store.read(url, start, end), start, end)

    async def _hedged(self, url: str, attempt: Callable[[], Coroutine[Any, Any, T]],
                      start: int | None, end: int | None) -> T:
        """A remote read, retried; a second, retried as well, if the first is slow."""
        def read() -> Coroutine[Any, Any, T]:
            return self._retried(url, attempt)

        large = start is not None and end is not None and end - start > HEDGE_MAX_BYTES
        if self._hedger is None or large:  # a large read is bound by bandwidth, not latency
            return await read()
        return await self._hedger.read(read)

    @contextmanager
    def as_current(self) -> Iterator[Storage]:
        """Make this the storage that module-level `read` uses in this context."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    async def aclose(self) -> None:
        """The remote stores, then the file threads, whatever fails on the way."""
        try:
            await self._coalescer.aclose()
            for store in self._stores.values():
                if store is not self._local:
                    await store.aclose()
        finally:
            await self._local.aclose()


def list_prefix(prefix: str) -> list[str]:
    """Every object under `prefix` (by whole path segments), in order, from the store of its
    scheme."""
    return store_class(prefix).list(prefix)


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
