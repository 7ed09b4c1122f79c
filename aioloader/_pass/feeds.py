"""Where a pass's raw items come from: one strategy per kind of source.

`PlannedSource` (map-style data) walks the epoch's plan and reads samples ahead of the batches
being decoded, as far as the budget allows (bytes held, samples ahead), with at most
`concurrency` reads in flight: a slow read delays its own batch, not the reads after it.
`StreamSource` pulls a stream's items one after another. `IterableSource` reads nothing: each
decode process fills its chunks from its own copy of an IterableDataset. Each hands complete
chunks on to the decode stage and reports the oldest read in flight to the watchdog.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import os
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .._cache import CACHED, SharedCache
from .._datasets import Dataset, Stream
from .._errors import FetchError, SampleError, SampleFetchError, typed
from .._ipc.messages import ChunkResult
from .._ipc.shared_bytes import SharedBytes
from .._sampling import EpochPlan
from .._stats import LoaderStats, now
from .._tasks import TaskSet
from .._worker.decode import one_line
from .autotune import ReadLimit

SKIPPED = object()
"""The raw item of a sample whose fetch failed with on_error="skip"."""
HOLD_SAMPLE = 8
"""A stream's items are weighed one in this many, for the memory limit."""


@dataclass(eq=False)
class Pending:
    """The samples of one decode task while the pass gathers them."""

    first_step: int
    steps: int
    indices: list[int]
    raws: list[Any]
    first_item: int | None = None
    """Streams: the position of the chunk's first item in this rank's stream (for keys)."""
    missing: int = 0
    held: int = 0
    """Bytes of raw items held, counted against the memory limit."""
    ahead: int = 0
    """Samples this chunk counts against the read-ahead bound."""
    reserved: int = 0
    """Bytes its decode may come to hold, promised to it out of the memory limit."""
    block: int = 0
    """Of those, its batch's block, until it is lent one."""
    failure: BaseException | None = None
    """With on_error="raise": the failure of the earliest sample that failed."""
    failed_at: int = -1
    worker: int | None = None
    """An IterableDataset's chunk: the decode process whose iterator fills it."""
    on_result: Callable[[ChunkResult], None] | None = None
    """An IterableDataset's chunk: told its result (whether that iterator ran out, where the
    copy stands)."""


class Work(Protocol):
    """The pass as a source sees it."""

    async def room(self) -> None:
        """Return once the budget allows reading more (bytes held, samples ahead)."""

    def reading(self, pending: Pending, count: int) -> None:
        """`count` more samples of `pending` are being read ahead of the decode stage."""

    def has_room(self) -> bool:
        """Whether reading more is allowed now (room() without awaiting)."""

    def hold(self, pending: Pending, raw: Any, weight: int = 1) -> None:
        """Count a raw item's bytes (times `weight`, for items weighed one in many) against
        the memory limit until its chunk is decoded."""

    def hold_all(self, pending: Pending, raws: list[Any]) -> None:
        """`hold` for a whole chunk's raw items at once."""

    def complete(self, pending: Pending) -> None:
        """Hand a chunk whose raws are all in to the decode stage."""

    def drop(self, pending: Pending) -> None:
        """A chunk that will not be decoded (drop_last): release what it holds."""


def estimate_bytes(value: Any, depth: int = 0) -> int:
    """Roughly what a raw item holds in memory, for the memory limit."""
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, memoryview | np.ndarray | SharedBytes):
        return int(value.nbytes)
    if depth < 2 and isinstance(value, (tuple, list)):
        return sum(estimate_bytes(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return sum(estimate_bytes(v, depth + 1) for v in value.values())
    return 64


class PlannedSource:
    """Map-style data: the plan's steps, chunk by chunk, every sample read through `fetch`
    (or a whole chunk through `fetch_many` when the dataset reads in batches)."""

    def __init__(
        self,
        dataset: Dataset,
        plan: EpochPlan,
        steps_per_chunk: int,
        skip_errors: bool,
        cache: SharedCache | None,
        reads: ReadLimit,
        stats: LoaderStats,
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self._steps_per_chunk = steps_per_chunk
        self._skip_errors = skip_errors
        self._cache = cache
        self._reads = reads
        self._stats = stats
        self._in_flight: dict[tuple[int, int], tuple[float, int]] = {}
        self._tasks = TaskSet()

    def position(self, steps_done: int) -> int:
        return self.plan.global_position(steps_done)

    def copies(self, steps_done: int) -> None:
        return None

    def key(self, pending: Pending, position: int) -> str:
        return sample_key(self.dataset, pending.indices[position])

    async def feed(self, work: Work) -> None:
        try:
            for first in range(0, len(self.plan), self._steps_per_chunk):
                steps = range(first, min(first + self._steps_per_chunk, len(self.plan)))
                indices = [int(i) for k in steps for i in self.plan.step(k)]
                pending = Pending(first, len(steps), indices, [None] * len(indices),
                                  missing=len(indices))
                await work.room()
                work.reading(pending, len(indices))
                await self._read(pending, work)
            while self._tasks:
                await asyncio.wait(self._tasks)
        finally:
            self._tasks.cancel_all()

    async def _read(self, pending: Pending, work: Work) -> None:
        if self.dataset.batched_fetch:
            if not self._reads.try_acquire():
                await self._reads.acquire(pending.first_step)
            self._tasks.start(self._fetch_many(pending, work))
            return
        for position, index in enumerate(pending.indices):
            if self._cache is not None and self._cache.lookup(index):
                self._arrived(pending, position, CACHED, work)
                continue
            if not self._reads.try_acquire():
                await self._reads.acquire(pending.first_step)
            self._tasks.start(self._fetch_one(pending, position, work))

    async def _fetch_one(self, pending: Pending, position: int, work: Work) -> None:
        index = pending.indices[position]
        started = now()
        self._in_flight[id(pending), position] = (started, index)
        try:
            raw = await self.dataset.fetch(index)
        except Exception as e:
            raw = self._failed(pending, position, e)
        else:
            self._record(started, 1)
        finally:
            self._reads.release()
            del self._in_flight[id(pending), position]
        self._arrived(pending, position, raw, work)

    async def _fetch_many(self, pending: Pending, work: Work) -> None:
        """The chunk's items in one call, those the cache holds left out (CACHED)."""
        started = now()
        self._in_flight[id(pending), 0] = (started, pending.indices[0])
        raws: list[Any] = [CACHED if self._cache is not None and self._cache.lookup(index)
                           else None for index in pending.indices]
        wanted = [position for position, raw in enumerate(raws) if raw is None]
        try:
            read = list(await self.dataset.fetch_many([pending.indices[p] for p in wanted])
                        if wanted else [])
            if len(read) != len(wanted):
                raise ValueError(f"fetch_many gave {len(read)} items for {len(wanted)}")
        except Exception:
            for position in wanted:  # find which sample failed, one by one
                try:
                    raws[position] = await self.dataset.fetch(pending.indices[position])
                except Exception as e:
                    raws[position] = self._failed(pending, position, e)
        else:
            for position, raw in zip(wanted, read, strict=True):
                raws[position] = raw
            if read:
                self._record(started, len(read))
        finally:
            self._reads.release()
            del self._in_flight[id(pending), 0]
        pending.raws, pending.missing = raws, 0
        work.hold_all(pending, raws)
        work.complete(pending)

    @staticmethod
    def _arrived(pending: Pending, position: int, raw: Any, work: Work) -> None:
        pending.raws[position] = raw
        work.hold(pending, raw)
        pending.missing -= 1
        if pending.missing == 0:
            work.complete(pending)

    def _record(self, started: float, count: int) -> None:
        ended = now()
        self._stats.fetch.add((ended - started) / count, count)
        self._stats.event("fetch", started, ended, "fetch")

    def _failed(self, pending: Pending, position: int, error: Exception) -> Any:
        """The failure as the pass treats it: skipped and counted, or the chunk's error."""
        index = pending.indices[position]
        failure = fetch_failure(index, sample_key(self.dataset, index), error)
        if self._skip_errors:
            self._stats.record_skip(str(failure))
            return SKIPPED
        if pending.failure is None or position < pending.failed_at:
            pending.failure, pending.failed_at = failure, position
        return None

    def oldest_read(self) -> tuple[float, str] | None:
        if not self._in_flight:
            return None
        started, index = min(self._in_flight.values())
        return now() - started, f"the read of sample {index} ({sample_key(self.dataset, index)})"


def fetch_failure(index: int, key: str, error: Exception) -> SampleError:
    if isinstance(error, FetchError):
        failure: SampleError = SampleFetchError(index, key, error)
    else:
        failure = typed(SampleError, type(error))(index, key, "fetch", one_line(error))
    failure.__cause__ = error
    return failure


def sample_key(dataset: Dataset, index: int) -> str:
    try:
        return dataset.key(index)
    except Exception:
        return str(index)


class StreamSource:
    """A stream's items, pulled one after another and grouped into chunks, each with the rng
    index the stream numbers it with (`Stream.numbered_from`)."""

    def __init__(
        self,
        stream: Stream,
        start: int,
        step_size: int,
        steps_per_chunk: int,
        keep_partial: bool,
        stats: LoaderStats,
    ) -> None:
        self.stream = stream
        self._start = start
        self._step_size = step_size
        self._chunk_size = step_size * steps_per_chunk
        self._steps_per_chunk = steps_per_chunk
        self._keep_partial = keep_partial
        self._stats = stats
        self._pulling_since: float | None = None
        self._count = start

    def position(self, steps_done: int) -> int:
        return self._start + steps_done * self._step_size

    def copies(self, steps_done: int) -> None:
        return None

    def key(self, pending: Pending, position: int) -> str:
        """Named only when an error needs it: a stream's items can come by the hundred
        thousand a second."""
        assert pending.first_item is not None
        return self.stream.key(pending.raws[position], pending.first_item + position)

    def _new(self, first_step: int) -> Pending:
        return Pending(first_step, self._steps_per_chunk, [], [], first_item=self._count)

    async def feed(self, work: Work) -> None:
        pending = self._new(0)
        items = self.stream.numbered_from(self._start)
        waited = 0.0
        async with aclosing(items):
            while True:
                if not work.has_room():  # no coroutine per item when there is room
                    await work.room()
                self._pulling_since = started = now()
                try:
                    number, item = await anext(items)
                except StopAsyncIteration:
                    break
                finally:
                    self._pulling_since = None
                waited += now() - started
                pending.indices.append(number)
                pending.raws.append(item)
                self._count += 1
                if len(pending.raws) % HOLD_SAMPLE == 1:  # a sample of sizes is enough
                    work.hold(pending, item, HOLD_SAMPLE)
                if len(pending.raws) == self._chunk_size:
                    self._complete(pending, work, waited)
                    waited = 0.0
                    pending = self._new(pending.first_step + self._steps_per_chunk)
        if pending.raws and self._keep_partial:
            pending.steps = -(-len(pending.raws) // self._step_size)
            self._complete(pending, work, waited)
        elif pending.raws:
            work.reading(pending, len(pending.raws))
            work.drop(pending)

    def _complete(self, pending: Pending, work: Work, waited: float) -> None:
        """Account a full chunk at once: per-item book-keeping is what limits a fast stream."""
        count = len(pending.raws)
        self._stats.fetch.add(waited / count, count)
        work.reading(pending, count)
        work.complete(pending)

    def oldest_read(self) -> tuple[float, str] | None:
        if self._pulling_since is None:
            return None
        return now() - self._pulling_since, f"the stream's item {self._count}"


class IterableSource:
    """An IterableDataset (`from_torch`): nothing is read here. Each decode process iterates its
    own copy, as a DataLoader worker does; the pass's chunks go to the workers in turn (chunk k
    to the k-th live one, cycling), each filled from its worker's iterator (its raw items are
    the pass's ticket, which names the iterator), so batches come in DataLoader's order. A
    worker whose iterator ran out gets no more; the feed ends when all have.

    Where the copies stand (`copies`) is booked from each chunk's result and read for the
    chunks handed over: `{"next": the worker whose turn is next, "workers": [where each copy
    stood, or None]}`. A pass resumed from it starts each copy there (its first chunk's raw
    items carry it) and the turns where they were."""

    def __init__(self, stream: Stream, workers: int, step_size: int, steps_per_chunk: int,
                 start: int, copies: dict[str, Any] | None) -> None:
        self.stream = stream
        self._workers = workers
        stood: list[dict[str, Any] | None] = (copies or {}).get("workers") or [None] * workers
        self._live = {w for w in range(workers) if not (stood[w] or {}).get("exhausted")}
        self._next = int((copies or {}).get("next", 0))
        self._resume = {w: where for w, where in enumerate(stood) if where is not None}
        self._stood = list(stood)
        """Where each copy stood after the last chunk handed over of it."""
        self._results: list[tuple[int, int, dict[str, Any]]] = []
        """(first step, worker, where it stood) of chunks decoded, not yet handed over: a
        heap."""
        self._turn_after_taken = self._next
        self._ticket = int.from_bytes(os.urandom(7), "little")
        self._chunk_size = step_size * steps_per_chunk
        self._step_size = step_size
        self._steps_per_chunk = steps_per_chunk
        self._start = start
        self._count = 0

    def position(self, steps_done: int) -> int:
        return self._start + steps_done * self._step_size

    def copies(self, steps_done: int) -> dict[str, Any] | None:
        """Where the copies stand once `steps_done` steps are handed over (which only grows)."""
        while self._results and self._results[0][0] < steps_done:
            _, worker, where = heapq.heappop(self._results)
            self._stood[worker] = where
            self._turn_after_taken = (worker + 1) % self._workers
        if all(where is None for where in self._stood):
            return None
        return {"next": self._turn_after_taken, "workers": list(self._stood)}

    def key(self, pending: Pending, position: int) -> str:
        assert pending.first_item is not None
        return self.stream.key(None, pending.first_item + position) + (
            f" of worker {pending.worker}")

    async def feed(self, work: Work) -> None:
        step = 0
        while (worker := self._turn()) is not None:
            await work.room()
            if worker not in self._live:  # it ran out while this waited
                continue
            raws: list[Any] = [self._ticket] * self._chunk_size
            if worker in self._resume:
                raws[0] = (self._ticket, self._resume.pop(worker))
            pending = Pending(step, self._steps_per_chunk,
                              list(range(self._count, self._count + self._chunk_size)), raws,
                              first_item=self._count, worker=worker,
                              on_result=functools.partial(self._booked, step, worker))
            self._count += self._chunk_size
            step += self._steps_per_chunk
            work.reading(pending, self._chunk_size)
            work.complete(pending)

    def _booked(self, step: int, worker: int, result: ChunkResult) -> None:
        if result.exhausted:
            self._live.discard(worker)
        if result.copy_state is not None:
            where = {**result.copy_state, "exhausted": result.exhausted}
            heapq.heappush(self._results, (step, worker, where))

    def _turn(self) -> int | None:
        """The next live worker in turn, None when none is left."""
        for offset in range(self._workers):
            worker = (self._next + offset) % self._workers
            if worker in self._live:
                self._next = worker + 1
                return worker
        return None

    def oldest_read(self) -> tuple[float, str] | None:
        return None
