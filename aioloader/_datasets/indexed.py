"""Streams whose samples are counted per unit (a tar shard, a Parquet row group) before the
epoch starts, so that an epoch divides among ranks by samples, not by units.

Every rank then gets the same number of samples (so DDP ranks take the same steps), `len()` is
known, a rank reads only its range (a partial unit included), and what remains of an epoch is
a set of positions of the epoch's sequence that any number of ranks can divide again.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import warnings
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Any

import numpy as np

from .._sampling import (
    Division,
    Indices,
    Intervals,
    SampleSequence,
    ShardInfo,
    Spawn,
    get_shard_info,
)
from ..storage import _storage as storage
from .base import Stream, digest
from .streaming import ordered_ahead

MIN_PIECE = 256
"""Samples read as one piece when they are small (a whole number of shuffle windows); large
samples are read a window at a time within the read budget."""


class IndexedStream(Stream):
    """Subclass with `unit_sizes` (samples per unit, in file order), `window` (samples shuffled
    together), `pieces_ahead` and `read_samples`; the division, the order and resuming come
    from here.

    The items of a rank come in pieces of whole shuffle windows; each piece is read with one
    read per unit it touches, `pieces_ahead` pieces at once (fewer when the pass's read budget
    in bytes is reached).
    """

    unit_sizes: Indices
    window: int
    pieces_ahead: int
    first_apart = False
    """Whether the first batch's samples are read apart, each its own range, before the rest of
    the first piece: worth it where a sample is a range of bytes (a tar member), not where
    any read takes a whole unit (a Parquet row group)."""

    @abc.abstractmethod
    async def read_samples(
        self, reads: storage.Storage, unit: int, start: int, stop: int, memo: dict[Any, Any]
    ) -> Sequence[Any]:
        """Samples `start` up to `stop` of `unit`, in storage order. `memo` lives as long as
        one iteration, for what reads of neighbouring pieces share (a decoded row group, a
        compressed shard's pass); what it holds with an `aclose` is closed with it."""

    def read_weight(self, unit: int, count: int) -> int:
        """Roughly what reading `count` samples of `unit` holds in memory, for the budget."""
        return 0

    def sequence(self, info: ShardInfo) -> SampleSequence:
        return SampleSequence(self.unit_sizes, info, self.window, Spawn.SAMPLE_SEQUENCE)

    def division(self, info: ShardInfo) -> Division:
        return Division(int(self.unit_sizes.sum()), info)

    def __len__(self) -> int:
        """This rank's items in the current epoch: the same on every rank."""
        return self.division(get_shard_info()).per_rank

    def locate(self, position: int) -> tuple[int, int]:
        """The unit and the sample in it of this rank's `position`-th item (to name it)."""
        info = get_shard_info()
        sequence = self.sequence(info)
        at = self.division(info).positions(position)[0][0]
        sample = sequence.ids(at, at + 1)
        unit = int(sequence.unit_of(sample)[0])
        return unit, int(sample[0] - sequence.offsets[unit])

    def fingerprint(self) -> dict[str, Any]:
        """Samples, units and a digest of the units' sizes: the epoch's sequence and what a
        saved state's intervals mean depend on them (a shard fewer, or one rewritten)."""
        sizes = np.ascontiguousarray(self.unit_sizes, np.int64)
        return {"samples": int(sizes.sum()), "units": len(sizes), "unit_sizes": digest(sizes)}

    def state_after(self, info: ShardInfo, done: int) -> Intervals:
        """The positions of the epoch's sequence no rank has taken once each took `done`."""
        return self.division(info).remaining_after(done)

    async def __aiter__(self) -> AsyncGenerator[Any, None]:
        async for _, item in self.numbered_from(0):
            yield item

    async def iter_from(self, position: int) -> AsyncGenerator[Any, None]:
        async for _, item in self.numbered_from(position):
            yield item

    async def numbered_from(self, position: int) -> AsyncGenerator[tuple[int, Any], None]:
        """(sample id, item) of this rank from its `position`-th item on: the id is the
        sample's place in the data, the same whatever the world size (it seeds the rng)."""
        info = get_shard_info()
        sequence = self.sequence(info)
        budget = info.read_bytes
        windows = MIN_PIECE // sequence.window
        if budget is not None:  # big samples: fewer windows a piece, within the budget
            windows = min(windows, budget // max(1, sequence.window * self._sample_bytes()))
        pieces = _pieces(self.division(info).positions(position),
                         sequence.window * max(1, windows))
        early = info.first_items if self.first_apart and pieces and (
            0 < info.first_items < pieces[0][1] - pieces[0][0]) else 0
        memo: dict[Any, Any] = {}
        warned = False
        async with storage.borrowed() as reads:

            def job(start: int, end: int) -> tuple[Any, int]:
                nonlocal warned
                ids = sequence.ids(start, end)
                units = sequence.unit_of(ids)
                found, counts = np.unique(units, return_counts=True)
                weight = sum(self.read_weight(u, n) for u, n in zip(
                    found.tolist(), counts.tolist(), strict=True))
                if budget is not None and weight > budget and not warned:
                    warned = True
                    warnings.warn(
                        f"{type(self).__name__}: a shuffle window reads about "
                        f"{weight >> 20} MiB, over the {budget >> 20} MiB the memory limit "
                        "leaves for reading ahead; it is read all the same. A smaller window "
                        "(or a larger memory_limit) keeps memory within the limit",
                        RuntimeWarning, stacklevel=2)
                return (lambda: self._read_piece(reads, sequence, ids, units, memo)), weight

            def jobs() -> Iterator[tuple[Any, int]]:
                """The pieces' reads; with `early`, the first batch's samples of the first
                piece come first, read apart, and the pieces' reads start once they are in
                (else they share the link and the server with them); the first piece gives
                the others."""
                if not early:
                    yield from (job(s, e) for s, e in pieces)
                    return
                start = pieces[0][0]
                ids = sequence.ids(start, start + early)
                first_in = asyncio.Event()

                async def read_early() -> tuple[Indices, list[Any]]:
                    try:
                        return await self._read_apart(reads, sequence, ids, memo)
                    finally:
                        first_in.set()

                async def after_early(read: Any, skip: int) -> tuple[Indices, list[Any]]:
                    await first_in.wait()
                    ids, items = await read()
                    return ids[skip:], items[skip:]

                yield read_early, job(start, start + early)[1]
                for n, (s, e) in enumerate(pieces):
                    read, weight = job(s, e)
                    yield functools.partial(after_early, read, early if n == 0 else 0), weight

            try:
                async for ids, items in ordered_ahead(jobs(), self.pieces_ahead, budget,
                                                      info.read_room):
                    for pair in zip(ids.tolist(), items, strict=True):
                        yield pair
            finally:  # what the reads kept open in the memo (a shard's pass: compressed.Unpacked)
                for kept in memo.values():
                    if hasattr(kept, "aclose"):
                        await kept.aclose()

    def _sample_bytes(self) -> int:
        """What a sample holds once read, on average."""
        sizes: list[int] = self.unit_sizes.tolist()
        total = sum(self.read_weight(unit, size) for unit, size in enumerate(sizes))
        return total // max(1, sum(sizes))

    async def _read_piece(
        self,
        reads: storage.Storage,
        sequence: SampleSequence,
        ids: Indices,
        units: Indices,
        memo: dict[Any, Any],
    ) -> tuple[Indices, list[Any]]:
        """A piece's items in sequence order: one read per unit, from the first sample needed
        there to the last (a partial window at a rank's edge reads its span once)."""
        items: list[Any] = [None] * len(ids)

        async def read_unit(unit: int) -> None:
            where = np.flatnonzero(units == unit)
            local = ids[where] - sequence.offsets[unit]
            first = int(local.min())
            read = await self.read_samples(reads, unit, first, int(local.max()) + 1, memo)
            for slot, at in zip(where.tolist(), (local - first).tolist(), strict=True):
                items[slot] = read[at]

        await asyncio.gather(*(read_unit(unit) for unit in np.unique(units).tolist()))
        return ids, items

    async def _read_apart(
        self, reads: storage.Storage, sequence: SampleSequence, ids: Indices,
        memo: dict[Any, Any],
    ) -> tuple[Indices, list[Any]]:
        """Samples `ids` in sequence order, one read for each run of neighbours."""
        units = sequence.unit_of(ids)
        local = ids - sequence.offsets[units]
        items: list[Any] = [None] * len(ids)

        async def read_run(slots: list[int]) -> None:
            unit, first = int(units[slots[0]]), int(local[slots[0]])
            read = await self.read_samples(reads, unit, first, first + len(slots), memo)
            for slot, item in zip(slots, read, strict=True):
                items[slot] = item

        await asyncio.gather(*(read_run(run) for run in _runs(units, local)))
        return ids, items


def _runs(units: Indices, local: Indices) -> list[list[int]]:
    """The places of `local` (samples of `units`) grouped into runs of neighbouring samples of
    one unit, each run in storage order."""
    order = sorted(range(len(local)), key=lambda n: (int(units[n]), int(local[n])))
    runs: list[list[int]] = []
    for n in order:
        last = runs[-1][-1] if runs else None
        if last is not None and units[last] == units[n] and local[last] + 1 == local[n]:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def _pieces(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges cut at multiples of `size` (a whole number of shuffle windows)."""
    out = []
    for start, end in ranges:
        while start < end:
            stop = min(end, (start // size + 1) * size)
            out.append((start, stop))
            start = stop
    return out
