"""What every map-style dataset offers the loader: a length, an async fetch, a key per sample."""

from __future__ import annotations

import abc
import hashlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Mapping,
    Sequence,
)
from contextlib import aclosing
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LoaderError
from .._sampling import epoch_order, get_shard_info


class Described:
    """What a loader's state records of its data, and the check of a state made for other
    data: the same position in other data (a file fewer, another order) would resume other
    samples, silently. One mechanism for every kind of data, mixtures included."""

    def fingerprint(self) -> dict[str, Any] | None:
        """What a saved position means depends on (lengths, sizes, a digest of the keys):
        small, JSON-serialisable, made without I/O. None: nothing to check."""
        return None

    def state_changes(self, saved: Any) -> list[str]:
        """What differs between this data and a state's fingerprint of the data it was saved
        for, in words; empty when it fits."""
        return differences(saved, self.fingerprint())

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Refuse a state saved for other data, naming what differs. A state without a
        fingerprint (its "dataset" entry: saved by an older version) is accepted."""
        saved = state.get("dataset", state.get("mixture"))  # where a Mix kept it before
        if saved is None:
            return
        changes = self.state_changes(saved)
        if changes:
            raise LoaderError("this state was saved for other data: " + "; ".join(changes)
                              + "; resuming would not continue the saved run")


def differences(saved: Any, now: dict[str, Any] | None) -> list[str]:
    """Field by field, how a fingerprint of now differs from a saved one."""
    if now is None:
        return []
    if not isinstance(saved, Mapping):
        return [f"its description {saved!r} is not one state_dict() gave"]
    if set(saved) != set(now):
        return [f"it was described by {sorted(saved)}, this data by {sorted(now)}"]
    return [f"{name} {saved[name]}, now {value}" for name, value in now.items()
            if saved[name] != value]


def digest(*parts: npt.NDArray[Any] | str) -> str:
    """A short digest of arrays' contents (and strings), as a fingerprint keeps it."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.encode() if isinstance(part, str) else
                      np.ascontiguousarray(part).data)
    return hashed.hexdigest()[:16]


class Dataset(Described, abc.ABC):
    """Subclass with `__len__` and `async def fetch(index)`; fetch runs in the event loop.

    `fetch` should only await I/O (use `aioloader.storage.read` to share the loader's
    connection pool); decoding belongs in the loader's `decode` function, which runs in the pool.
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    async def fetch(self, index: int) -> Any:
        """The raw item at `index` (bytes, or anything picklable for `decode`)."""

    batched_fetch: bool = False
    """True when `fetch_many` reads a chunk of samples more cheaply than `fetch` one by one
    (files on local disk, data in memory): the loader then makes one call per chunk instead of
    one task per sample."""

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        """The raw items at `indices`, in order; used when `batched_fetch` is True."""
        return [await self.fetch(index) for index in indices]

    def epoch_order(self, shuffle: bool, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        """The order of an epoch's samples, which the ranks share in lockstep; override for an
        order of your own. The default: a permutation from (seed, epoch) when shuffling."""
        return epoch_order(len(self), shuffle, seed, epoch)

    def check_world_size(self, world_size: int) -> None:
        """Refuse a loader's world size this dataset cannot serve (one it already divides
        itself); the default accepts all."""
        return

    def load_in_workers(self) -> tuple[Callable[[Any], Any], int] | None:
        """For datasets read inside the decode processes (`from_torch`): the function that
        turns what `fetch` gives into the sample there, and how many run at once on threads
        (so blocking reads overlap). None: `fetch` gives the raw item itself."""
        return None

    reads_in_decode = False
    """`fetch` gives where each sample is, and the decode processes read it (a copy that
    `for_local_decode` made)."""

    def for_local_decode(self) -> Dataset | None:
        """This data as decode processes on this machine take it best, when that is cheaper
        than reading it here and sending the bytes on (large local files read there, large
        remote objects in shared memory); None, the default: read in the event loop and sent."""
        return None

    def key(self, index: int) -> str:
        """A name for the sample at `index`, used in error messages."""
        return str(index)

    def fingerprint(self) -> dict[str, Any] | None:
        """The length; override to add what defines the order (a digest of the keys)."""
        return {"length": len(self)}


class Stream(Described, abc.ABC):
    """Streaming (iterable) data: subclass with `def __aiter__` (an async generator) yielding
    raw items, which go through the same decode pool, batching and prefetch as map-style data.

    The loader iterates a stream once, in its event loop, so no item is read twice; with several
    ranks, read only this rank's share (`aioloader.get_shard_info()` says which).

    Resuming mid-epoch: the loader calls `iter_from(position)`, position being the number of
    items this rank had handed over. The default replays the epoch and drops that many, which
    is exact for any stream whose order depends only on `get_shard_info()`; override it to
    jump there directly.
    """

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[Any]: ...

    async def iter_from(self, position: int) -> AsyncGenerator[Any, None]:
        """This rank's items of the epoch from the `position`-th on."""
        dropped = 0
        async for item in self:
            if dropped < position:
                dropped += 1
                continue
            yield item

    async def numbered_from(self, position: int) -> AsyncGenerator[tuple[int, Any], None]:
        """(rng index, item) of this rank's items from the `position`-th on. The index seeds
        the item's rng: by default item n of rank r gets n * world_size + r, distinct across
        ranks; streams that know a sample's place in the data give that instead."""
        info = get_shard_info()
        items = self.iter_from(position) if position else _items(self)
        number = position * info.world_size + info.rank
        async with aclosing(items):
            async for item in items:
                yield number, item
                number += info.world_size

    def check_batching(self, batch_size: int | None, ordered: bool) -> None:
        """Refuse loader settings this stream cannot serve; the default accepts all."""
        return

    @staticmethod
    def from_factory(factory: Callable[[], AsyncIterable[Any]]) -> Stream:
        """A Stream whose epochs come from `factory()`, an async iterable (call
        `get_shard_info()` inside it to read this rank's share)."""
        return _FactoryStream(factory)

    def key(self, item: Any, position: int) -> str:
        """A name for an item, used in error messages: `__url__#__key__` for dict samples."""
        if isinstance(item, Mapping) and "__key__" in item:
            return f"{item.get('__url__', '')}#{item['__key__']}"
        return f"item {position}"


async def _items(stream: Stream) -> AsyncGenerator[Any, None]:
    """A stream's items as an async generator, so that it can be closed early."""
    async for item in stream:
        yield item


class _FactoryStream(Stream):
    def __init__(self, factory: Callable[[], AsyncIterable[Any]]) -> None:
        self._factory = factory

    async def __aiter__(self) -> AsyncGenerator[Any, None]:
        async for item in self._factory():
            yield item
