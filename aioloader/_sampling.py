"""The index order of an epoch, and which part of it each rank takes at each step.

The global order depends only on (length, shuffle, seed, epoch). Ranks move through it in
lockstep: at step k they together take the next `world_size * step_size` samples, rank r the
r-th share. A position in the global order therefore resumes any rank, at any world size.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

Indices = npt.NDArray[np.int64]
Intervals = tuple[tuple[int, int], ...]
"""Half-open ranges [start, end) of positions, in increasing order."""
T = TypeVar("T")


class Spawn(IntEnum):
    """Spawn keys of the random streams: each thing ordered (samples, shards, files, windows,
    draws) gets its own, apart from the per-sample streams and from each other."""

    ORDER = 1
    WORKER_SEEDS = 2
    SAMPLE_SEQUENCE = 3
    FILE_ORDER = 5
    MIX_DRAWS = 7
    MIX_SOURCES = 8
    """The first of the mixture's sources; source s uses MIX_SOURCES + s, so it stays last."""


def epoch_order(
    length: int, shuffle: bool, seed: int, epoch: int, stream: int = Spawn.ORDER
) -> Indices:
    """0..length-1, permuted with (seed, epoch) when shuffling; `stream` keeps the orders of
    different things (samples, shards, files) independent."""
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    sequence = np.random.SeedSequence([seed, epoch], spawn_key=(stream,))
    return np.random.default_rng(sequence).permutation(length).astype(np.int64)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator handed to decode for one sample: the same wherever it is decoded."""
    return np.random.default_rng([seed, epoch, index])


def steps_in_epoch(length: int, step_size: int, world_size: int, drop_last: bool) -> int:
    """How many steps an epoch of `length` samples has, without building its order."""
    group = step_size * world_size
    if drop_last:
        return length // group
    padded = -(-length // world_size) * world_size
    return -(-padded // group)


class EpochPlan:
    """The steps of one epoch for one rank, from a global position onwards; computed lazily.

    What remains after `start` is padded (or, with drop_last, cut) for this world size, so a
    job resumed on another number of ranks still gives every rank a share of equal length.
    """

    def __init__(
        self,
        order: Indices,
        step_size: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        start: int = 0,
    ) -> None:
        group = step_size * world_size
        remaining = order[start:]
        if drop_last:
            remaining = remaining[: len(remaining) // group * group]
        elif len(remaining) % world_size:  # pad with the epoch's first samples, as torch does
            wrap = world_size - len(remaining) % world_size
            remaining = np.concatenate([remaining, np.resize(order, wrap)])
        self._order = remaining
        self.start = start
        self._step_size = step_size
        self._rank = rank
        self._world_size = world_size

    def __len__(self) -> int:
        return -(-len(self._order) // (self._step_size * self._world_size))

    def step(self, k: int) -> Indices:
        """The indices this rank takes at step k (counted from `start`)."""
        group = self._step_size * self._world_size
        chunk = self._order[k * group : (k + 1) * group]
        share = len(chunk) // self._world_size
        return chunk[self._rank * share : (self._rank + 1) * share]

    def global_position(self, steps_done: int) -> int:
        """Where the global order stands after `steps_done` steps of every rank."""
        group = self._step_size * self._world_size
        return self.start + min(steps_done * group, len(self._order))


def default_rank_and_world_size() -> tuple[int, int]:
    """torch.distributed when initialised, else RANK / WORLD_SIZE, else a single process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class ReadRoom(Protocol):
    """The memory limit's account as a stream reading ahead sees it: a piece is read ahead
    only if it fits, and is counted until it is handed over."""

    def fits(self, size: int) -> bool: ...

    def hold(self, size: int) -> None: ...

    def let_go(self, size: int) -> None: ...


@dataclass(frozen=True)
class ShardInfo:
    """What a stream needs to read its share of an epoch."""

    rank: int
    world_size: int
    epoch: int
    seed: int
    shuffle: bool
    drop_last: bool = False
    """Streams divided by samples: cut the epoch to equal shares instead of padding it."""
    remaining: Intervals | None = None
    """Streams divided by samples, resumed mid-epoch: the positions of the epoch's sequence
    that no rank has taken yet (None: all of them)."""
    read_bytes: int | None = None
    """What a stream may hold in reads ahead of the consumer, in bytes (None: no bound)."""
    read_room: ReadRoom | None = None
    """The memory limit's account, for what a stream reads ahead (None: none kept)."""
    first_items: int = 0
    """Items the pass's first batch takes from this rank (0: not known). A stream that reads
    in large pieces may read these apart, first, so the first batch waits for them only."""


_shard_info: contextvars.ContextVar[ShardInfo | None] = contextvars.ContextVar(
    "aioloader_shard_info", default=None
)


def get_shard_info() -> ShardInfo:
    """Inside a stream's iteration: this rank, the world size, the epoch, the seed, shuffle.

    Outside a loader: rank 0 of 1 (or RANK / WORLD_SIZE), epoch 0, seed 0, no shuffle.
    """
    info = _shard_info.get()
    if info is None:
        rank, world_size = default_rank_and_world_size()
        return ShardInfo(rank, world_size, 0, 0, False)
    return info


def call_with_shard_info(info: ShardInfo, function: Callable[[], T]) -> T:
    """Call `function` in a copy of the current context where `get_shard_info()` is `info`
    (tasks it creates inherit that context); the caller's context is left alone."""

    def call() -> T:
        _shard_info.set(info)
        return function()

    return contextvars.copy_context().run(call)


class SampleSequence:
    """The order of an epoch of samples stored in units (tar shards, row groups): the units in
    the epoch's order, their samples in storage order, permuted within windows of `window`
    consecutive positions when shuffling. So neighbouring positions lie in one or two units and
    a window is read with a few large reads; memory holds about a window.

    A sample's id is its place in the units taken in file order: unit u holds ids
    `offsets[u]` up to `offsets[u + 1]`.
    """

    def __init__(self, sizes: Indices, info: ShardInfo, window: int, stream: int) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        self.window = max(1, window) if info.shuffle else 1
        self._units = epoch_order(len(sizes), info.shuffle, info.seed, info.epoch, stream)
        self._ordered_starts = np.concatenate([[0], np.cumsum(sizes[self._units])]).astype(np.int64)
        self._seed = (info.seed, info.epoch, stream)

    def ids(self, start: int, end: int) -> Indices:
        """The sample ids at positions start..end of the sequence."""
        if start >= end:
            return np.empty(0, np.int64)
        first, last = start // self.window * self.window, -(-end // self.window) * self.window
        positions = np.arange(first, min(last, self.total), dtype=np.int64)
        slot = np.searchsorted(self._ordered_starts, positions, side="right") - 1
        ids = self.offsets[self._units[slot]] + positions - self._ordered_starts[slot]
        if self.window > 1:
            for at in range(0, len(ids), self.window):
                seed, epoch, stream = self._seed
                sequence = np.random.SeedSequence(
                    [seed, epoch, (first + at) // self.window], spawn_key=(stream,))
                np.random.default_rng(sequence).shuffle(ids[at : at + self.window])
        return ids[start - first : end - first]

    def unit_of(self, ids: Indices) -> Indices:
        """The unit (in file order) that holds each sample id."""
        units: Indices = np.searchsorted(self.offsets, ids, side="right") - 1
        return units


class Division:
    """Each rank's share of the positions of an epoch's sequence that remain: the remaining
    positions taken in order are cut into `world_size` contiguous ranges of equal length, so a
    rank reads runs of neighbouring samples. Without drop_last the last range is padded with
    the epoch's first positions (every sample is read at least once, as DistributedSampler
    pads; a job resumed on the same world size pads as it would have); with drop_last the
    fewer than `world_size` left over are cut (no repeats).

    The positions a rank has taken after `done` items are the first `done` of its range, so
    what remains after any step is known from the step alone: `remaining_after` gives the
    intervals a job resumed on any world size divides again.
    """

    def __init__(self, total: int, info: ShardInfo) -> None:
        world_size = info.world_size
        if total == 0 or (info.drop_last and total < world_size):
            raise ValueError(
                f"{total} samples cannot give each of {world_size} ranks one"
                + (" with drop_last" if info.drop_last else "")
            )
        self._intervals: Intervals = ((0, total),) if info.remaining is None else info.remaining
        lengths = np.array([end - start for start, end in self._intervals], np.int64)
        self._before = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.remaining = int(self._before[-1])
        """What this division shares out; less than `total` when resuming (0: the epoch is
        done)."""
        self.per_rank = (self.remaining // world_size if info.drop_last
                         else -(-self.remaining // world_size))
        self._world_size = world_size
        self._rank = info.rank
        self._total = total

    def positions(self, skip: int = 0) -> list[tuple[int, int]]:
        """This rank's range of sequence positions after its first `skip`, as intervals."""
        first = self._rank * self.per_rank + min(skip, self.per_rank)
        last = (self._rank + 1) * self.per_rank
        out = self._sequence_ranges(first, min(last, self.remaining))
        pad = max(first, self.remaining) - self.remaining
        while pad < last - self.remaining:  # padding: the epoch's first positions again
            start = pad % self._total
            stop = start + min(last - self.remaining - pad, self._total - start)
            out.append((start, stop))
            pad += stop - start
        return out

    def _sequence_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Remaining positions start..stop (counted among the remaining) as sequence ranges."""
        out = []
        slot = int(np.searchsorted(self._before, start, side="right")) - 1
        while start < stop:
            base, (first, last) = int(self._before[slot]), self._intervals[slot]
            end = min(stop, base + last - first)
            out.append((first + start - base, first + end - base))
            start, slot = end, slot + 1
        return out

    def remaining_after(self, done: int) -> Intervals:
        """The sequence positions no rank has taken once every rank took `done` items."""
        done, size = min(done, self.per_rank), self.per_rank
        untaken = [(r * size + done, min((r + 1) * size, self.remaining))
                   for r in range(self._world_size)]
        untaken.append((self._world_size * size, self.remaining))  # what drop_last cut
        kept: list[tuple[int, int]] = []
        for start, stop in untaken:
            for first, last in self._sequence_ranges(start, stop):
                if kept and kept[-1][1] == first:
                    kept[-1] = (kept[-1][0], last)
                else:
                    kept.append((first, last))
        return tuple(kept)


def check_intervals(value: Any, total: int) -> Intervals:
    """Intervals from a saved state, checked: increasing, disjoint, within 0..total."""
    try:
        pairs = tuple((int(a), int(b)) for a, b in value)
        exact = all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                    for pair in value for x in pair)
    except (TypeError, ValueError):
        exact, pairs = False, ()
    previous = 0
    for start, end in pairs:
        if not exact or not previous <= start < end <= total:
            break
        previous = end
    else:
        if exact:
            return pairs
    raise ValueError(f"'remaining' must be increasing, disjoint [start, end) pairs within "
                     f"0..{total}, got {value!r}")
