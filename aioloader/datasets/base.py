"""What every map-style dataset offers the loader: a length, an async fetch, a key per sample."""

from __future__ import annotations

import abc
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
