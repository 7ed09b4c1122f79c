"""A weighted mixture of sources: each sample of the mixture comes from one source, drawn with
the weights from (seed, epoch, position), so the mixture is the same for any number of decode
processes, any concurrency and any world size.

Source s's k-th draw takes element k of its own endless sequence of passes: pass j = k // len
in the order that source would have for that pass (shuffled per pass when the loader shuffles),
so a small source can be upweighted and simply starts over, reshuffled, when it runs out.
Every mixture epoch starts each source on a fresh pass.

With map-style sources only, the mixture is a map-style dataset over its positions: the loader
resumes it from a global position, elastically across world sizes. With a stream among them,
it is a stream, read per rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LoaderError
from .._sampling import ShardInfo, Spawn, call_with_shard_info, epoch_order, get_shard_info
from ..storage import _storage as storage
from .base import Dataset, Described, Stream
from .streaming import ordered_ahead

BLOCK = 1 << 16
"""Positions whose draws are made at once: draws are computed block by block, never the whole
epoch, so an epoch of billions costs nothing up front."""
_KEPT_BLOCKS = 4
_KEPT_ORDERS = 8
@dataclass(frozen=True)
class Mixed:
    """A raw item of a mixture: the name of its source and the source's own raw item; what
    `decode` receives, so that one decode can treat each source its own way."""

    source: str
    item: Any


def pass_epoch(epoch: int, passes: int) -> int:
    """The epoch number a source's pass `passes` of mixture epoch `epoch` is read as."""
    return epoch * (1 << 20) + passes


class Draws:
    """Which source each position of an epoch draws, and how many draws of that source came
    before it."""

    def __init__(self, weights: Sequence[float]) -> None:
        """`weights`: finite, summing to 1."""
        self._edges = np.cumsum(np.asarray(weights, float))
        self._edges[-1] = 1.0
        self._sources = len(weights)
        self._blocks: OrderedDict[tuple[int, int, int], tuple[Any, Any]] = OrderedDict()
        self._bases: dict[tuple[int, int], list[npt.NDArray[np.int64]]] = {}

    def _draw_block(self, seed: int, epoch: int, block: int) -> npt.NDArray[np.int64]:
        sequence = np.random.SeedSequence([seed, epoch, block], spawn_key=(Spawn.MIX_DRAWS,))
        uniform = np.random.default_rng(sequence).random(BLOCK)
        return np.searchsorted(self._edges, uniform, side="right").astype(np.int64)

    def _base(self, seed: int, epoch: int, block: int) -> npt.NDArray[np.int64]:
        """Draws of each source in the blocks before `block`."""
        bases = self._bases.setdefault((seed, epoch), [np.zeros(self._sources, np.int64)])
        while len(bases) <= block:
            drawn = self._draw_block(seed, epoch, len(bases) - 1)
            bases.append(bases[-1] + np.bincount(drawn, minlength=self._sources))
        return bases[block]

    def _block(self, seed: int, epoch: int, block: int) -> tuple[Any, Any]:
        """(source, draws of that source before this position) for each position of a block."""
        key = (seed, epoch, block)
        found = self._blocks.pop(key, None)
        if found is None:
            sources = self._draw_block(seed, epoch, block)
            before = np.empty(BLOCK, np.int64)
            base = self._base(seed, epoch, block)
            for source in range(self._sources):
                where = np.flatnonzero(sources == source)
                before[where] = base[source] + np.arange(len(where))
            found = (sources, before)
        self._blocks[key] = found
        while len(self._blocks) > _KEPT_BLOCKS:
            self._blocks.popitem(last=False)
        return found

    def at(self, seed: int, epoch: int, position: int) -> tuple[int, int]:
        """(source, k): position draws source, as that source's k-th draw of the epoch."""
        block, offset = divmod(position, BLOCK)
        sources, before = self._block(seed, epoch, block)
        return int(sources[offset]), int(before[offset])

    def counts(self, seed: int, epoch: int, position: int) -> list[int]:
        """Draws of each source at positions before `position`."""
        block, offset = divmod(position, BLOCK)
        base = self._base(seed, epoch, block)
        sources, _ = self._block(seed, epoch, block)
        counts: list[int] = (base + np.bincount(sources[:offset], minlength=self._sources)).tolist()
        return counts


class _Sources:
    """The named sources, their weights, and where a source's k-th draw lands."""

    def __init__(self, sources: Mapping[str, Any] | Sequence[Any],
                 weights: Sequence[float] | None) -> None:
        named = dict(sources) if isinstance(sources, Mapping) else {
            str(n): s for n, s in enumerate(sources)}
        if not named:
            raise ValueError("Mix needs at least one source")
        self.names = list(named)
        self.sources = list(named.values())
        self.weights = normalised(self.names, [1.0] * len(named) if weights is None else weights)
        self.draws = Draws(self.weights)
        self.drawn = [0] * len(named)
        """Items each source returned so far (a draw counts once its item is in hand):
        `shares()` reports them."""
        self._orders: OrderedDict[tuple[int, ...], npt.NDArray[np.int64]] = OrderedDict()

    def order(self, source: int, info: ShardInfo, passes: int, length: int) -> Any:
        """The order of a source's pass `passes` in this epoch (the order the loader would
        give it, with an epoch of its own per pass)."""
        key = (source, info.seed, info.epoch, passes, int(info.shuffle))
        order = self._orders.pop(key, None)
        if order is None:
            order = epoch_order(length, info.shuffle, info.seed, pass_epoch(info.epoch, passes),
                                Spawn.MIX_SOURCES + source)
        self._orders[key] = order
        while len(self._orders) > _KEPT_ORDERS:
            self._orders.popitem(last=False)
        return order

    def element(self, source: int, k: int, info: ShardInfo, length: int) -> int:
        """The index in the source of its k-th draw in the epoch."""
        passes, at = divmod(k, length)
        return int(self.order(source, info, passes, length)[at])

    def shares(self) -> dict[str, float]:
        total = sum(self.drawn)
        return {name: round(count / total, 4) if total else 0.0
                for name, count in zip(self.names, self.drawn, strict=True)}


def normalised(names: Sequence[str], weights: Sequence[float]) -> list[float]:
    """The weights scaled to sum to 1: each finite and >= 0, not all 0. Divided by the largest
    first, so that weights near the float maximum do not overflow their sum."""
    weights = list(weights)
    if len(weights) != len(names):
        raise ValueError(f"Mix needs one weight per source ({len(names)}), got {weights}")
    for name, weight in zip(names, weights, strict=True):
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"the weight of source {name!r} is {weight!r}: Mix needs one "
                             "weight per source, a finite number >= 0")
    largest = max(weights)
    if not largest:
        raise ValueError(f"Mix needs at least one weight above 0, got {weights}")
    scaled = [weight / largest for weight in weights]
    total = math.fsum(scaled)
    return [weight / total for weight in scaled]


class _Mixture(Described):
    """What both kinds of mixture tell about themselves: shares drawn, and a description a
    saved state is checked against."""

    _mix: _Sources

    def shares(self) -> dict[str, float]:
        return self._mix.shares()

    def _lengths(self) -> list[int | None]:
        """Each source's length; None for a stream, whose share of a rank is known only in a
        pass."""
        return [None if isinstance(s, Stream) else len(s) for s in self._mix.sources]

    def fingerprint(self) -> dict[str, Any]:
        """Each source (in draw order) with its weight, its length and its own fingerprint:
        what a saved position means depends on them."""
        described: dict[str, Any] = {}
        for name, weight, length, source in zip(self._mix.names, self._mix.weights,
                                                self._lengths(), self._mix.sources, strict=True):
            described[name] = {"weight": weight, "length": length}
            inner = source.fingerprint()
            if inner is not None:
                described[name]["dataset"] = inner
        return described

    def state_changes(self, saved: Any) -> list[str]:
        """Other sources, weights (to rounding: `[6, 3, 1]` and `[0.6, 0.3, 0.1]` are the same
        weights), lengths, or a source's own data; a state saved before sources described
        themselves is checked on the rest."""
        if not (isinstance(saved, Mapping) and all(
                isinstance(was, Mapping) and "weight" in was for was in saved.values())):
            return [f"it was not saved for a mixture, but for data described by {saved!r}"]
        if list(saved) != self._mix.names:
            return [f"a mixture of the sources {list(saved)}, not {self._mix.names}"]
        changes = []
        for (name, was), weight, length, source in zip(saved.items(), self._mix.weights,
                                                       self._lengths(), self._mix.sources,
                                                       strict=True):
            if not math.isclose(was["weight"], weight, rel_tol=1e-9):
                changes.append(f"source {name!r} had weight {was['weight']:.6g}, now {weight:.6g}")
            if was.get("length") != length:
                changes.append(f"source {name!r} had {was.get('length')} samples, now {length}")
            elif "dataset" in was:
                changes += [f"source {name!r}: {change}"
                            for change in source.state_changes(was["dataset"])]
        return changes


class MixDataset(_Mixture, Dataset):
    """A mixture of map-style sources: position p of an epoch is one draw."""

    def __init__(self, sources: _Sources, samples_per_epoch: int) -> None:
        self._mix = sources
        self._length = samples_per_epoch
        self.batched_fetch = True

    def __len__(self) -> int:
        return self._length

    def epoch_order(self, shuffle: bool, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        """Positions in order: the draws are already random, and each source keeps its own
        (shuffled) order."""
        return np.arange(self._length, dtype=np.int64)

    def _where(self, position: int) -> tuple[int, int]:
        """(source, index in the source) of a position, in this pass's epoch."""
        info = get_shard_info()
        source, k = self._mix.draws.at(info.seed, info.epoch, position)
        length = len(self._mix.sources[source])
        return source, self._mix.element(source, k, info, length)

    def key(self, index: int) -> str:
        source, inner = self._where(index)
        name = self._mix.names[source]
        return f"{name}:{self._mix.sources[source].key(inner)}"

    async def fetch(self, index: int) -> Mixed:
        source, inner = self._where(index)
        item = await self._mix.sources[source].fetch(inner)
        self._mix.drawn[source] += 1
        return Mixed(self._mix.names[source], item)

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        """Each source's share of a chunk in one call when it reads in batches. Draws count
        only when every item is in: the loader reads a failed chunk again through `fetch`."""
        where = [self._where(i) for i in indices]
        out: list[Any] = [None] * len(indices)
        groups: dict[int, list[int]] = {}
        for n, (source, _) in enumerate(where):
            groups.setdefault(source, []).append(n)

        async def read(source: int, slots: list[int]) -> None:
            dataset = self._mix.sources[source]
            inner = [where[n][1] for n in slots]
            if dataset.batched_fetch:
                items = await dataset.fetch_many(inner)
            else:
                items = await asyncio.gather(*(dataset.fetch(i) for i in inner))
            for n, item in zip(slots, items, strict=True):
                out[n] = Mixed(self._mix.names[source], item)

        await asyncio.gather(*(read(s, slots) for s, slots in groups.items()))
        for source, slots in groups.items():
            self._mix.drawn[source] += len(slots)
        return out

    def state_at(self, epoch: int, seed: int, position: int) -> dict[str, Any]:
        """Each source's pass and position at a global position of an epoch (for people
        reading a checkpoint: the position alone resumes the mixture)."""
        counts = self._mix.draws.counts(seed, epoch, position)
        return {
            name: {"pass": count // len(source), "position": count % len(source)}
            for name, source, count in zip(self._mix.names, self._mix.sources, counts,
                                            strict=True)
        }


class MixStream(_Mixture, Stream):
    """A mixture with a stream among its sources: read per rank. Item n of this rank draws at
    position n * world_size + rank; a stream source that runs out starts its next pass."""

    def __init__(self, sources: _Sources, samples_per_epoch: int | None) -> None:
        self._mix = sources
        self._samples = samples_per_epoch

    def _per_rank(self, info: ShardInfo) -> int:
        """Items of this rank in an epoch: samples_per_epoch / world_size, or, by default, the
        sum of the sources' shares for this rank."""
        if self._samples is not None:
            return self._samples // info.world_size
        total = 0
        for source in self._mix.sources:
            if not hasattr(source, "__len__"):
                raise TypeError("a Mix with a stream that has no __len__ needs samples_per_epoch")
            sized: Sized = source
            if isinstance(source, Stream):
                total += call_with_shard_info(info, sized.__len__)
            else:
                total += len(sized) // info.world_size
        return total

    def __len__(self) -> int:
        return self._per_rank(get_shard_info())

    def key(self, item: Any, position: int) -> str:
        inner = item.item if isinstance(item, Mixed) else item
        name = item.source if isinstance(item, Mixed) else "?"
        return f"{name}:{Stream.key(self, inner, position)}"

    async def __aiter__(self) -> AsyncGenerator[Mixed, None]:
        async for item in self.iter_from(0):
            yield item

    async def iter_from(self, position: int) -> AsyncGenerator[Mixed, None]:
        """Jumps: each source resumes at the draws it had given before `position`."""
        info = get_shard_info()
        stop = self._per_rank(info)
        draws = self._mix.draws
        taken = [0] * len(self._mix.sources)
        for n in range(position):
            taken[draws.at(info.seed, info.epoch, n * info.world_size + info.rank)[0]] += 1
        ahead = await _reads_allowed()
        readers = [_Reader(self._mix, s, info, taken[s], ahead) for s in range(len(taken))]
        try:
            for n in range(position, stop):
                source, _ = draws.at(info.seed, info.epoch, n * info.world_size + info.rank)
                item = await readers[source].next()
                self._mix.drawn[source] += 1
                yield Mixed(self._mix.names[source], item)
        finally:
            for reader in readers:
                await reader.aclose()


async def _reads_allowed() -> int:
    """Reads the running loader keeps in flight (its storage's concurrency), so that a
    map-style source inside a stream mixture reads as far ahead as the loader would read it
    alone; the stream itself is pulled one item at a time."""
    async with storage.borrowed() as reads:
        return reads.concurrency


class _Reader:
    """A source read as one endless sequence of passes (this rank's share of each), from its
    k-th item on."""

    def __init__(self, mix: _Sources, source: int, info: ShardInfo, skip: int,
                 ahead: int) -> None:
        self._mix = mix
        self._source = source
        self._info = info
        self._passes = 0
        self._skip = skip
        self._ahead = ahead
        self._items: AsyncGenerator[Any, None] | None = None
        self._gave = False
        """Whether the current pass gave an item yet."""

    def _pass_info(self) -> ShardInfo:
        epoch = pass_epoch(self._info.epoch, self._passes)
        return ShardInfo(self._info.rank, self._info.world_size, epoch, self._info.seed,
                         self._info.shuffle)

    def _open(self) -> AsyncGenerator[Any, None]:
        dataset = self._mix.sources[self._source]
        info = self._pass_info()
        if isinstance(dataset, Stream):
            return _read_in(info, dataset, self._ahead)
        order = self._mix.order(self._source, self._info, self._passes, len(dataset))
        return _dataset_items(dataset, order[info.rank :: info.world_size], self._ahead)

    async def next(self) -> Any:
        """The next item, starting the source's next pass when one ends. A pass without a
        single item fails: the source has nothing for this rank, and the next pass would have
        nothing either (opening them one after another, without ever awaiting, would hang the
        loop and its stall watchdog with it)."""
        while True:
            if self._items is None:
                self._items, self._gave = self._open(), False
            try:
                item = await anext(self._items)
            except StopAsyncIteration:
                self._items = None
                if not self._gave:
                    name = self._mix.names[self._source]
                    raise LoaderError(
                        f"source {name!r} of the mixture gave no items for rank "
                        f"{self._info.rank} of {self._info.world_size}") from None
                self._passes += 1
                await asyncio.sleep(0)  # skipping may run through passes: let the loop run
                continue
            self._gave = True
            if self._skip:
                self._skip -= 1
                continue
            return item

    async def aclose(self) -> None:
        if self._items is not None:
            with contextlib.suppress(Exception):
                await self._items.aclose()


_END = object()


async def _read_in(info: ShardInfo, stream: Stream, ahead: int) -> AsyncGenerator[Any, None]:
    """A stream's pass read by a task of its own, which sees `info` as its shard info: a
    generator runs in the context of whoever pulls it, so the pass's epoch must travel in the
    context of a task that does all of its pulling."""
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue(max(1, ahead))

    async def produce() -> None:
        try:
            async with contextlib.aclosing(stream.iter_from(0)) as items:
                async for item in items:
                    await queue.put((item, None))
            await queue.put((_END, None))
        except Exception as e:
            await queue.put((None, e))

    task = call_with_shard_info(info, lambda: asyncio.ensure_future(produce()))
    try:
        while True:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                return
            yield item
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _dataset_items(dataset: Dataset, indices: Any,
                         ahead: int) -> AsyncGenerator[Any, None]:
    """A map-style source's pass as a stream (this rank's share), `ahead` reads in flight."""
    jobs = ((functools.partial(dataset.fetch, index), 0) for index in indices.tolist())
    async with contextlib.aclosing(ordered_ahead(jobs, max(0, ahead - 1))) as items:
        async for item in items:
            yield item


def Mix(
    sources: Mapping[str, Any] | Sequence[Any],
    weights: Sequence[float] | None = None,
    samples_per_epoch: int | None = None,
) -> MixDataset | MixStream:
    """A weighted mixture of sources (`Files`, `RecordIO`, `Parquet`, `TarShards`, your own
    datasets and streams), by name: `Mix({"web": a, "code": b}, weights=[0.7, 0.3])`.

    Each sample comes from one source, drawn with the weights from (seed, epoch, position);
    `decode` receives `Mixed(source, item)`: the source's name and its raw item. An epoch is
    `samples_per_epoch` samples (default: the sum of the sources' lengths). A source that runs
    out starts its next pass, reshuffled when the loader shuffles, so a small source can be
    upweighted. `loader.stats.sources` reports the share drawn from each source.
    """
    mix = _Sources(sources, weights)
    lengths = [len(s) if hasattr(s, "__len__") and not isinstance(s, Stream) else None
               for s in mix.sources]
    if samples_per_epoch is not None and (
        isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, int)
        or samples_per_epoch < 1
    ):
        raise ValueError(f"samples_per_epoch must be an integer >= 1, got {samples_per_epoch!r}")
    if all(isinstance(s, Dataset) for s in mix.sources):
        if any(length == 0 for length in lengths):
            raise ValueError("a source of the mixture is empty")
        return MixDataset(mix, samples_per_epoch or sum(int(n or 0) for n in lengths))
    for source in mix.sources:
        if not isinstance(source, (Dataset, Stream)):
            raise TypeError(f"Mix takes aioloader Datasets and Streams, got "
                            f"{type(source).__name__}")
    return MixStream(mix, samples_per_epoch)
