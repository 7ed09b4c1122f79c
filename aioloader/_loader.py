"""The Loader: wires sampler, fetch, decode and batching, and owns their lifecycle.

One epoch is one `_EpochRun` in one event loop: a producer task launches a bounded window of
chunk tasks (fetch every sample of a batch with at most `concurrency` reads in flight, then
decode and collate the batch in the pool) and hands finished chunks, in order or as completed,
to a queue of `prefetch` batches. `async for` reads that queue directly; a plain `for` runs the
same run on a loop in a background thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import traceback
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sized
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from ._cache import CACHED, SharedCache
from ._closing import AsyncClosing, Closing
from ._collate import default_collate
from ._datasets import Dataset, Stream
from ._errors import LoaderError, SampleError
from ._loopthread import LoopThread
from ._runtime import autotune
from ._runtime.transport import BlockPool, Slot
from ._runtime.transport import available as transport_available
from ._runtime.workers import (
    Chunk,
    ChunkResult,
    DecodePool,
    DecodeSpec,
    ExecutorPool,
    check_picklable,
    takes_rng,
)
from ._sampling import (
    EpochPlan,
    ShardInfo,
    call_with_shard_info,
    default_rank_and_world_size,
    epoch_order,
    steps_in_epoch,
)
from ._stats import LoaderStats, now
from .storage._diskcache import DEFAULT_LIMIT as DEFAULT_DISK_CACHE_LIMIT
from .storage._diskcache import DiskCache
from .storage._retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT, RetryPolicy
from .storage._storage import Storage

UNBATCHED_CHUNK = 16
"""Samples per decode task when batch_size is None: amortises the pipe without hurting latency."""

_END = object()
_SKIPPED = object()
_EMPTY = object()


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class Loader(Closing, AsyncClosing):
    """Batches of decoded samples from a dataset; see the README for every argument."""

    def __init__(
        self,
        dataset: Dataset | Stream,
        decode: Callable[..., Any] | None = None,
        batch_size: int | None = 64,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        concurrency: int | Literal["auto"] = 64,
        num_workers: int = 2,
        prefetch: int = 4,
        ordered: bool = True,
        collate: Callable[[list[Any]], Any] = default_collate,
        worker_init: Callable[[int], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        on_error: Literal["raise", "skip"] = "raise",
        persistent_workers: bool = False,
        retries: int = DEFAULT_RETRIES,
        timeout: float = DEFAULT_TIMEOUT,
        executor: Executor | None = None,
        shared_memory: bool = True,
        augment: Callable[..., Any] | None = None,
        cache: SharedCache | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int = DEFAULT_DISK_CACHE_LIMIT,
    ) -> None:
        if not isinstance(dataset, Stream) and not (
            hasattr(dataset, "fetch") and hasattr(dataset, "__len__")
        ):
            raise TypeError(
                "dataset must be an aioloader.Dataset (__len__ and async fetch(index)) or an "
                f"aioloader.Stream (async __aiter__), got {type(dataset).__name__}"
            )
        _check_count("batch_size", batch_size, minimum=1, allow_none=True)
        self.auto_concurrency = concurrency == "auto"
        if concurrency == "auto":
            concurrency = autotune.START
        _check_count("concurrency", concurrency, minimum=1)
        _check_count("num_workers", num_workers, minimum=0)
        _check_count("prefetch", prefetch, minimum=1)
        _check_count("seed", seed, minimum=0)
        if isinstance(dataset, Stream):
            dataset.check_batching(batch_size, ordered)
        if on_error not in ("raise", "skip"):
            raise ValueError(f'on_error must be "raise" or "skip", got {on_error!r}')
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be a function or None, got {decode!r}")
        default_rank, default_world = default_rank_and_world_size()
        self.rank = default_rank if rank is None else rank
        self.world_size = default_world if world_size is None else world_size
        _check_count("world_size", self.world_size, minimum=1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank}")
        if executor is not None and worker_init is not None:
            raise ValueError("worker_init runs in the built-in decode processes; with executor=, "
                             "set up the executor's workers yourself")
        if cache is not None:
            if isinstance(dataset, Stream):
                raise ValueError("cache= needs map-style data: a stream has no stable index")
            if takes_rng(decode):
                raise ValueError("decode= feeds the cache, so it must not be random: move the "
                                 "random part into augment=(value, rng)")
            cache.attach(len(dataset))
        if num_workers or executor is not None:
            check_picklable("augment", augment)
            check_picklable("decode", decode)
            check_picklable("collate", collate)
            check_picklable("worker_init", worker_init)
        RetryPolicy(retries, timeout)  # validates both

        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.concurrency = concurrency
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.ordered = ordered
        self.on_error = on_error
        self.persistent_workers = persistent_workers
        self.retries = retries
        self.timeout = timeout
        self.stats = LoaderStats()
        self.cache = cache
        self.disk_cache = None if cache_dir is None else DiskCache(cache_dir, cache_limit)
        self._spec = DecodeSpec(
            decode, collate if batch_size else None, on_error == "skip", seed, augment, cache
        )
        self._worker_init = worker_init
        self.executor = executor
        self._epoch = 0
        self._position = 0
        """Global position in the epoch's order of the last batch handed over."""
        self._resume_at: int | None = None
        self._closed = False
        self._pools = _PoolHolder()
        self._blocks: BlockPool | None = None
        if shared_memory and num_workers and executor is None and transport_available():
            most_reads = autotune.HIGHEST if self.auto_concurrency else concurrency
            self._blocks = BlockPool(max_blocks=self._window(most_reads) + prefetch + 4)
        self._finalizer = weakref.finalize(self, _shut_down, self._pools, self._blocks)

    # -- epochs and state ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of `epoch` (its order depends on it)."""
        _check_count("epoch", epoch, minimum=0)
        self._epoch, self._position, self._resume_at = epoch, 0, None

    def state_dict(self) -> dict[str, int]:
        """Where this loader stands: small and JSON-serialisable.

        Map-style data: the position in the epoch's global order, valid for any rank and any
        world size. A stream: the items this rank handed over, and the world size, which a
        resumed stream must keep (its share of the data depends on it).
        """
        state = {"epoch": self._epoch, "position": self._position}
        if isinstance(self.dataset, Stream):
            state["world_size"] = self.world_size
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration continues the saved epoch at the saved position."""
        if isinstance(self.dataset, Stream) and state.get("world_size") != self.world_size:
            raise LoaderError(
                f"this stream's state was saved with world size {state.get('world_size')}; "
                f"a stream resumes only with the same world size, not {self.world_size}"
            )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._resume_at = self._position

    def _plan(self, start: int) -> EpochPlan | None:
        """The epoch's steps for map-style data; None for a stream, which orders itself."""
        if isinstance(self.dataset, Stream):
            return None
        order = epoch_order(len(self.dataset), self.shuffle, self.seed, self._epoch)
        return EpochPlan(
            order, self.batch_size or 1, self.rank, self.world_size, self.drop_last, start
        )

    def __len__(self) -> int:
        """Batches per epoch for this rank (samples when batch_size is None)."""
        step = self.batch_size or 1
        if not isinstance(self.dataset, Stream):
            return steps_in_epoch(len(self.dataset), step, self.world_size, self.drop_last)
        if not hasattr(self.dataset, "__len__"):
            raise TypeError("this Loader reads a Stream without __len__: its length is unknown")
        dataset = cast(Sized, self.dataset)
        items = call_with_shard_info(self._shard_info(self._epoch), lambda: len(dataset))
        return items // step if self.drop_last else -(-items // step)

    def _window(self, reads: int | None = None) -> int:
        """Chunks in flight: enough to keep `reads` (default: the concurrency now) busy while
        every decode process has a chunk; a bound on memory too."""
        per_chunk = (self.batch_size or 1) * (1 if self.batch_size else UNBATCHED_CHUNK)
        return -(-(reads or self.concurrency) // per_chunk) + self.num_workers + 1

    def _shard_info(self, epoch: int) -> ShardInfo:
        return ShardInfo(self.rank, self.world_size, epoch, self.seed, self.shuffle)

    # -- iteration ---------------------------------------------------------------------------

    async def _open_run(self) -> _EpochRun:
        if self._closed:
            raise LoaderError("this Loader is closed; build a new one")
        start = self._resume_at or 0
        self._position, self._resume_at = start, None
        pool = self._pools.get(self)
        return _EpochRun(self, self._plan(start), start, pool)

    async def _close_run(self, run: _EpochRun) -> None:
        try:
            await run.aclose()
        finally:
            if run.finished:
                self._epoch, self._position = self._epoch + 1, 0
            if not self.persistent_workers or run.pool.broken:
                self._pools.close()
                if self._blocks is not None:
                    self._blocks.sweep()

    async def _iterate(self) -> AsyncIterator[Any]:
        run = await self._open_run()
        try:
            while (item := await run.next()) is not _END:
                yield item
        finally:
            await self._close_run(run)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    def __iter__(self) -> Iterator[Any]:
        loop = LoopThread()
        try:
            run = loop.call(self._open_run())
            try:
                while (item := loop.call(run.next())) is not _END:
                    yield item
            finally:
                loop.call(self._close_run(run))
        finally:
            loop.stop()

    def timeline(self, path: str | Path) -> Path:
        """Draw what the loader did (the most recent events) as a PNG at `path`; needs
        matplotlib. Reads overlap in the fetch row: darker means more in flight."""
        from ._tools.timeline import draw

        return draw(self.stats.events, path, title=self.stats.verdict())

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the decode processes and unlink the shared memory; idempotent. Iterations in
        progress end with an error; batches already handed over stay valid."""
        self._closed = True
        self._finalizer()

    async def aclose(self) -> None:
        self.close()


def _shut_down(pools: _PoolHolder, blocks: BlockPool | None) -> None:
    """Processes first: none may create a block after the blocks are removed."""
    pools.close()
    if blocks is not None:
        blocks.close()


class _PoolHolder:
    """The loader's decode pool, built on first use; kept apart so a finalizer can close it."""

    def __init__(self) -> None:
        self._pool: DecodePool | None = None
        self._lock = threading.Lock()

    def get(self, loader: Loader) -> DecodePool | ExecutorPool:
        if loader.executor is not None:
            return ExecutorPool(loader._spec, loader.executor)
        with self._lock:
            if self._pool is None:
                base_seed = int(
                    np.random.SeedSequence([loader.seed, loader.epoch], spawn_key=(2,))
                    .generate_state(1)[0]
                )
                self._pool = DecodePool(
                    loader._spec, loader.num_workers, base_seed, loader._worker_init
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


@dataclass
class _Job:
    """The samples of one chunk: which steps they fill, their indices, and their raw items
    (fetched by the chunk task for map-style data; already read for a stream)."""

    steps: range
    indices: list[int]
    raws: list[Any] | None = None
    keys: list[str] | None = None


class _EpochRun:
    """One pass over (the rest of) an epoch inside one event loop."""

    def __init__(
        self,
        loader: Loader,
        plan: EpochPlan | None,
        start: int,
        pool: DecodePool | ExecutorPool,
    ) -> None:
        self._loader = loader
        self._epoch = loader.epoch
        self._plan = plan
        self._start = start
        self.pool = pool
        self.finished = False
        self._step_size = loader.batch_size or 1
        self._steps_per_chunk = 1 if loader.batch_size else UNBATCHED_CHUNK
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=loader.prefetch)
        self._fetch_slots: asyncio.Semaphore | autotune.ReadLimit = asyncio.Semaphore(
            loader.concurrency
        )
        connections = loader.concurrency
        if loader.auto_concurrency:
            self._fetch_slots = autotune.ReadLimit(loader.concurrency)
            connections = autotune.HIGHEST
        self._storage = Storage(
            connections, loader.retries, loader.timeout, loader.stats.storage, loader.disk_cache
        )
        self._delivered = _Progress()
        stats = loader.stats
        stats.concurrency, stats.decode_processes = loader.concurrency, loader.num_workers
        self._started, self._busy_before = now(), stats.busy_seconds
        self._handed_over_at: float | None = None
        info = loader._shard_info(self._epoch)

        def start_producer() -> asyncio.Task[None]:
            """The producer and its tasks see this run's storage and shard info."""
            with self._storage.as_current():
                return asyncio.create_task(self._produce(), name="aioloader-producer")

        self._producer = call_with_shard_info(info, start_producer)
        self._tuner: asyncio.Task[None] | None = None
        if isinstance(self._fetch_slots, autotune.ReadLimit):
            tuner = autotune.Tuner(self._fetch_slots, stats, self._use_concurrency)
            self._tuner = asyncio.create_task(tuner.tune(), name="aioloader-tuner")

    def _use_concurrency(self, limit: int) -> None:
        self._loader.concurrency = self._loader.stats.concurrency = limit

    async def next(self) -> Any:
        """The next batch, or _END; raises the first failure of the run."""
        stats = self._loader.stats
        asked = now()
        if self._handed_over_at is not None:
            stats.event("consumer", self._handed_over_at, asked, "step")
        while True:
            entry = await self._queue.get()
            if entry is _END:
                self.finished = True
                return _END
            if isinstance(entry, _Failure):
                raise entry.error
            step, item, queued_at = entry
            got = now()
            stats.queue_wait.add(got - queued_at)
            stats.busy_seconds = self._busy_before + got - self._started
            steps_done = self._delivered.add(step)
            self._loader._position = (
                self._start + steps_done * self._step_size
                if self._plan is None
                else self._plan.global_position(steps_done)
            )
            if item is not _EMPTY:
                stats.batches += 1
                stats.consumer_wait.add(got - asked)
                stats.event("consumer", asked, got, "wait")
                self._handed_over_at = got
                return item

    async def aclose(self) -> None:
        tasks = [t for t in (self._producer, self._tuner) if t is not None]
        for task in tasks:
            task.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self._storage.aclose()

    # -- producer side -----------------------------------------------------------------------

    async def _produce(self) -> None:
        in_flight: deque[asyncio.Task[list[tuple[int, Any]]]] = deque()
        try:
            jobs = self._planned_jobs() if self._plan is not None else self._stream_jobs()
            async for job in jobs:
                while len(in_flight) >= self._loader._window():
                    await self._deliver_one(in_flight)
                in_flight.append(asyncio.create_task(self._complete(job)))
            while in_flight:
                await self._deliver_one(in_flight)
            await self._queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await self._queue.put(_Failure(e))
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _planned_jobs(self) -> AsyncIterator[_Job]:
        plan = self._plan
        assert plan is not None
        for first in range(0, len(plan), self._steps_per_chunk):
            steps = range(first, min(first + self._steps_per_chunk, len(plan)))
            yield _Job(steps, [int(i) for k in steps for i in plan.step(k)])

    async def _stream_jobs(self) -> AsyncIterator[_Job]:
        """Group a stream's items into chunks; item n of this rank gets the rng index
        n * world_size + rank, distinct across ranks."""
        stream = self._loader.dataset
        assert isinstance(stream, Stream)
        rank, world_size = self._loader.rank, self._loader.world_size
        chunk_size = self._step_size * self._steps_per_chunk
        first_step, count = 0, self._start
        job = _Job(range(0), [], [], [])
        start = stream.iter_from(self._start) if self._start else _aiter(stream)
        async with aclosing(start) as items:
            async for item in items:
                assert job.raws is not None and job.keys is not None
                job.indices.append(count * world_size + rank)
                job.raws.append(item)
                job.keys.append(stream.key(item, count))
                count += 1
                if len(job.raws) == chunk_size:
                    job.steps = range(first_step, first_step + self._steps_per_chunk)
                    first_step += self._steps_per_chunk
                    yield job
                    job = _Job(range(0), [], [], [])
        assert job.raws is not None
        if job.raws and not (self._loader.drop_last and self._loader.batch_size):
            job.steps = range(first_step, first_step + -(-len(job.raws) // self._step_size))
            yield job

    async def _deliver_one(self, in_flight: deque[asyncio.Task[list[tuple[int, Any]]]]) -> None:
        """Hand over the oldest chunk (ordered) or whichever finishes first."""
        if self._loader.ordered:
            task = in_flight[0]
            await asyncio.wait([task])
        else:
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            task = done.pop()
        in_flight.remove(task)
        for step, item in task.result():
            await self._queue.put((step, item, now()))

    async def _complete(self, job: _Job) -> list[tuple[int, Any]]:
        """Fetch (if needed), decode and collate a job's samples; one (step, item) per step."""
        raws = job.raws
        if raws is None:
            fetched = await asyncio.gather(
                *(self._fetch(i) for i in job.indices), return_exceptions=True
            )
            for raw in fetched:
                if isinstance(raw, BaseException):
                    raise raw
            raws = fetched
        kept = [n for n, raw in enumerate(raws) if raw is not _SKIPPED]
        blocks = self._loader._blocks
        slot = blocks.lease() if blocks is not None else None
        chunk = Chunk(self._epoch, [job.indices[n] for n in kept], [raws[n] for n in kept], slot)
        try:
            result = await self.pool.run(chunk)
        except BaseException:
            if blocks is not None and slot is not None:
                blocks.release(slot.name)
            raise
        self._receive(result, slot)
        self._report_caches()
        for start, end in result.timings:
            self._loader.stats.decode.add(end - start)
            self._loader.stats.event(result.process, start, end, "decode")
        self._account(chunk, result, lambda position: self._job_key(job, kept[position]))
        if self._loader.batch_size:
            return [(job.steps[0], result.items[0] if result.items else _EMPTY)]
        decoded = iter(result.items)
        skipped = {kept[position] for position, _ in result.skipped}
        skipped.update(n for n, raw in enumerate(raws) if raw is _SKIPPED)
        return [(k, _EMPTY if n in skipped else next(decoded)) for n, k in enumerate(job.steps)]

    def _report_caches(self) -> None:
        loader = self._loader
        report = {} if loader.cache is None else loader.cache.report()
        disk = loader.disk_cache
        if disk is not None:
            report.update(disk_hits=disk.hits, disk_misses=disk.misses,
                          disk_gib=round(disk.size / (1 << 30), 4))
        loader.stats.cache = report

    def _receive(self, result: ChunkResult, slot: Slot | None) -> None:
        """Map a result's arrays out of its shared block, or give the unused block back."""
        blocks, transport = self._loader._blocks, self._loader.stats.transport
        if blocks is not None and slot is not None:
            if result.shared:
                result.items = blocks.adopt(result.items, slot)
                transport["shared"] += 1
                return
            if result.needed > slot.size > 0:
                blocks.retire(slot.name)  # too small for these batches: a fresh one next time
            else:
                blocks.release(slot.name)
        if result.items and self._loader.num_workers:
            transport["pickled"] += 1

    def _account(self, chunk: Chunk, result: ChunkResult, key: Callable[[int], str]) -> None:
        stats = self._loader.stats
        for position, text in result.skipped:
            error = SampleError(chunk.indices[position], key(position), "decode", text)
            stats.record_skip(str(error))
        if result.failure is not None:
            failed, text = result.failure
            if failed is None:
                raise LoaderError(f"collate failed for samples {chunk.indices}:\n{text}")
            position = chunk.indices.index(failed)
            raise SampleError(failed, key(position), "decode", text)
        stats.samples += len(chunk.indices) - len(result.skipped)

    async def _fetch(self, index: int) -> Any:
        dataset = self._loader.dataset
        assert not isinstance(dataset, Stream)
        cache = self._loader.cache
        if cache is not None and cache.lookup(index):
            return CACHED
        async with self._fetch_slots:
            started = now()
            try:
                raw = await dataset.fetch(index)
                ended = now()
                self._loader.stats.fetch.add(ended - started)
                self._loader.stats.event("fetch", started, ended, "fetch")
                return raw
            except Exception as e:
                error = SampleError(index, self._key(index), "fetch", traceback.format_exc())
                if self._loader.on_error == "raise":
                    raise error from e
                self._loader.stats.record_skip(str(error))
                return _SKIPPED

    def _job_key(self, job: _Job, n: int) -> str:
        return job.keys[n] if job.keys is not None else self._key(job.indices[n])

    def _key(self, index: int) -> str:
        """Map-style data only: a stream's keys travel with its jobs."""
        try:
            return self._loader.dataset.key(index)  # type: ignore[call-arg]
        except Exception:
            return str(index)


async def _aiter(stream: Stream) -> AsyncGenerator[Any, None]:
    """A stream's items as an async generator, so that it can be closed early."""
    async for item in stream:
        yield item


class _Progress:
    """Counts delivered steps as a contiguous prefix, whatever order they arrive in."""

    def __init__(self) -> None:
        self._prefix = 0
        self._ahead: set[int] = set()

    def add(self, step: int) -> int:
        self._ahead.add(step)
        while self._prefix in self._ahead:
            self._ahead.remove(self._prefix)
            self._prefix += 1
        return self._prefix


def _check_count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
