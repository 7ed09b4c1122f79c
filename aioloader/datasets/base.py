"""What every map-style dataset offers the loader: a length, an async fetch, a key per sample."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Mapping
from typing import Any


class Dataset(abc.ABC):
    """Subclass with `__len__` and `async def fetch(index)`; fetch runs in the event loop.

    `fetch` should only await I/O (use `aioloader.storage.read` to share the loader's
    connection pool); decoding belongs in the loader's `decode` function, which runs in the pool.
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    async def fetch(self, index: int) -> Any:
        """The raw item at `index` (bytes, or anything picklable for `decode`)."""

    def key(self, index: int) -> str:
        """A name for the sample at `index`, used in error messages."""
        return str(index)


class Stream(abc.ABC):
    """Streaming (iterable) data: subclass with `def __aiter__` (an async generator) yielding
    raw items, which go through the same decode pool, batching and prefetch as map-style data.

    The loader iterates a stream once, in its event loop, so no item is read twice; with several
    ranks, read only this rank's share (`aioloader.get_shard_info()` says which).
    """

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Any]: ...

    def key(self, item: Any, position: int) -> str:
        """A name for an item, used in error messages: `__url__#__key__` for dict samples."""
        if isinstance(item, Mapping) and "__key__" in item:
            return f"{item.get('__url__', '')}#{item['__key__']}"
        return f"item {position}"
