"""The Loader: configuration, the decode pool it keeps, and where it stands in the epochs.

Each iteration is a pass (`_runtime.passes.Pass`) built from a snapshot of the configuration, in
the event loop that iterates: the caller's for `async for`, a loop in a background thread for a
plain `for`. A Loader runs one pass at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sized
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from ._cache import SharedCache
from ._closing import AsyncClosing, Closing, ProcessBound
from ._collate import default_collate
from ._datasets import Dataset, Stream
from ._datasets.indexed import IndexedStream
from ._errors import LoaderError
from ._loopthread import LoopThread
from ._runtime import autotune, shm
from ._runtime.blocking import off_loop
from ._runtime.channel import dumps
from ._runtime.decode import DecodeSpec, takes_rng
from ._runtime.decoders import Decoder, ExecutorDecoder, InlineDecoder, PoolDecoder
from ._runtime.passes import END, Pass, PassConfig
from ._runtime.pool import DecodePool
from ._runtime.preload import packages_behind
from ._runtime.sources import PlannedSource, StreamSource
from ._runtime.transport import BlockPool
from ._runtime.zygote import Zygote
from ._sampling import (
    EpochPlan,
    Intervals,
    ShardInfo,
    Spawn,
    call_with_shard_info,
    check_intervals,
    default_rank_and_world_size,
    steps_in_epoch,
)
from ._stats import LoaderStats
from .storage._diskcache import DEFAULT_LIMIT as DEFAULT_DISK_CACHE_LIMIT
from .storage._diskcache import DiskCache
from .storage._hedge import Hedger
from .storage._limits import DEFAULT_MAX_OBJECT_BYTES
from .storage._retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT, RetryPolicy
from .storage._storage import Storage

UNBATCHED_CHUNK = 16
"""Samples per decode task when batch_size is None: amortises the pipe without hurting latency."""
DEFAULT_MEMORY_LIMIT = 1 << 30
READ_AHEAD_PER_READ = 32
"""Samples read ahead of the decode stage per read in flight (bounded by memory_limit too)."""
CLOSE_WAIT_SECONDS = 5.0


class Loader(Closing, AsyncClosing):
    """Batches of decoded samples from a dataset, read with many reads in flight.

    Iterate it with `for` (the event loop runs in a background thread) or `async for` (in
    the running loop); `with`/`async with` or `close()` stop everything it started.

    Args:
        dataset: an `aioloader.Dataset` (map-style: `__len__` and `async fetch(index)`) or an
            `aioloader.Stream` (iterable: `async __aiter__`).
        decode: `decode(raw)` or `decode(raw, rng)`, run in the decode processes on each raw
            item; the rng is passed only when the second parameter is named `rng` or annotated
            `numpy.random.Generator`, and is `numpy.random.default_rng([seed, epoch, index])`,
            so results do not depend on num_workers or concurrency. None: raw items as they are.
            Any function works (lambdas, closures, notebook cells): it travels by value.
        batch_size: samples per batch; None gives samples one by one.
        shuffle: a new order each epoch, from `seed` and the epoch.
        seed: the seed of the order and of the per-sample rng.
        drop_last: leave out the last batch when it is not full.
        concurrency: reads in flight, or "auto" to find the number while running.
        num_workers: decode processes; 0 decodes in the event loop's thread (for debugging).
            With nothing to run in them (no decode, augment, cache or worker_init, the
            default collate), batches are collated in the loop's thread whatever the number.
        prefetch: finished batches kept ready for the consumer.
        ordered: False hands batches over as they finish rather than in order.
        collate: list of samples -> batch, in the decode processes (default: like torch's).
        worker_init: `worker_init(worker_id)`, run once in each decode process.
        rank, world_size: this process's share in distributed training; None: from
            torch.distributed, else the RANK and WORLD_SIZE variables, else 0 and 1.
        on_error: "raise" stops at a sample whose fetch or decode fails (after the batches
            before it); "skip" drops it, counts it in `stats.skipped` and goes on.
        persistent_workers: keep the decode processes between passes (until close()).
        retries, timeout: the read retry budget and the seconds a request may take.
        executor: a `concurrent.futures.Executor` (a Dask cluster's, say) to decode on instead
            of the built-in processes; it stays yours to close.
        shared_memory: hand large batches back through /dev/shm instead of pickles.
        augment: with `cache=`, the random step `augment(value, rng)` run every epoch on the
            cached output of `decode`.
        cache: an `aioloader.SharedCache` keeping decoded samples in shared memory.
        cache_dir, cache_limit: keep remote bytes in this folder, at most this many bytes.
        decode_timeout: seconds a decode task may run; longer raises DecodeTimeoutError (or
            skips its samples) and the process is killed and replaced. None: no limit.
        stall_timeout: seconds without any read, decode or hand-over completing, while one is
            in flight, before StallError names what holds the loader.
        max_worker_restarts: decode processes that may die in a pass (OOM killer, a crash)
            and be replaced, their work sent again, before WorkerDiedError.
        memory_limit: bytes of raw and decoded samples the loader holds, in flight or waiting
            for the consumer; no new read starts while it is over. None: 1 GiB.
        max_object_bytes: the most one read may return (2 GiB); a larger object, or a body
            that runs on, raises FetchError without retrying. Streams hold a chunk at a time
            and are not bound by it.
        hedge: when a remote read has taken longer than 97% of recent reads, send a second
            request for the same bytes and take the first answer; at most 5% more requests.
            One slow answer in a hundred then stops costing a second of the epoch.
    """

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
        decode_timeout: float | None = None,
        stall_timeout: float = 600.0,
        max_worker_restarts: int = 3,
        memory_limit: int | None = None,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        hedge: bool = True,
    ) -> None:
        if not isinstance(dataset, (Dataset, Stream)):
            raise TypeError(
                "dataset must be an aioloader.Dataset (subclass it: __len__ and async "
                "fetch(index)) or an aioloader.Stream (async __aiter__), got "
                f"{type(dataset).__name__}"
            )
        _check_count("batch_size", batch_size, minimum=1, allow_none=True)
        self.auto_concurrency = concurrency == "auto"
        if concurrency == "auto":
            concurrency = autotune.START
        _check_count("concurrency", concurrency, minimum=1)
        _check_count("num_workers", num_workers, minimum=0)
        _check_count("prefetch", prefetch, minimum=1)
        _check_count("seed", seed, minimum=0)
        _check_count("max_worker_restarts", max_worker_restarts, minimum=0)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("ordered", ordered),
                           ("persistent_workers", persistent_workers),
                           ("shared_memory", shared_memory), ("hedge", hedge)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        _check_seconds("decode_timeout", decode_timeout, allow_none=True)
        _check_seconds("stall_timeout", stall_timeout)
        _check_count("memory_limit", memory_limit, minimum=1, allow_none=True)
        _check_count("max_object_bytes", max_object_bytes, minimum=1)
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
        if isinstance(dataset, Dataset):
            dataset.check_world_size(self.world_size)
        if executor is not None and worker_init is not None:
            raise ValueError("worker_init runs in the built-in decode processes; with executor=, "
                             "set up the executor's workers yourself")
        if cache is not None:
            if isinstance(dataset, Stream):
                raise ValueError("cache= needs map-style data: a stream has no stable index")
            if takes_rng(decode):
                raise ValueError("decode= feeds the cache, so it must not be random: move the "
                                 "random part into augment=(value, rng)")
            cache._attach(len(dataset))
        RetryPolicy(retries, timeout)  # validates both

        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.concurrency = concurrency
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.ordered = bool(ordered)
        self.on_error = on_error
        self.persistent_workers = bool(persistent_workers)
        self.retries = retries
        self.timeout = timeout
        self.decode_timeout = decode_timeout
        self.stall_timeout = stall_timeout
        self.max_worker_restarts = max_worker_restarts
        self.memory_limit = DEFAULT_MEMORY_LIMIT if memory_limit is None else memory_limit
        self.max_object_bytes = max_object_bytes
        self.hedge = bool(hedge)
        self.stats = LoaderStats()
        self._hedger = Hedger(self.stats.storage) if hedge else None
        """Kept from pass to pass: what it learnt of read times is valid in the next epoch."""
        self.cache = cache
        self.disk_cache = None if cache_dir is None else DiskCache(cache_dir, cache_limit)
        self.stats.cache_reports = [c.report for c in (cache, self.disk_cache) if c is not None]
        self.stats.source_shares = getattr(dataset, "shares", None)
        self.executor = executor
        load, threads = (None, 1) if isinstance(dataset, Stream) else (
            dataset.load_in_workers() or (None, 1))
        self.stats.load_threads = threads if load is not None else 0
        self._spec = DecodeSpec(
            decode, collate if batch_size else None, on_error == "skip", seed, augment, cache,
            load, threads,
        )
        self._worker_init = worker_init
        if num_workers and executor is None:
            packages = packages_behind(self._check_serialisable())
            # start the helper that forks decode processes now, with what decode imports,
            # while the caller builds the rest of the job: the first pass need not wait for it
            threading.Thread(target=_start_zygote, args=(packages,),
                             name="aioloader-zygote-start", daemon=True).start()
        self._epoch = 0
        self._position = 0
        """Where the last pass stood: the global position in the epoch's order (map-style
        data), or the items this rank handed over (streams)."""
        self._resume_at: int | None = None
        self._remaining: Intervals | None = None
        """Streams divided by samples: what the last pass (or the next, when resuming) divides
        among the ranks; None for the whole epoch."""
        self._closed = False
        self._lock = threading.Lock()
        self._pass: Pass | None = None
        self._pass_loop: asyncio.AbstractEventLoop | None = None
        self._pass_ended = threading.Condition(self._lock)
        self._opening = False
        self._holder = _PoolHolder()
        self._blocks: BlockPool | None = None
        if shared_memory and num_workers and executor is None and shm.available():
            self._blocks = BlockPool(
                max_blocks=self._decode_window() + self._prefetch_chunks() + 4,
                max_bytes=self.memory_limit,
            )
        self._finalizer = weakref.finalize(self, _shut_down, self._holder, self._blocks)

    def _check_serialisable(self) -> list[bytes]:
        """Fail here, not in a decode process, when a function cannot travel; the pickles."""
        pickled = []
        for name, value in (("decode", self._spec), ("worker_init", self._worker_init)):
            try:
                pickled.append(dumps(value))
            except Exception as e:
                raise ValueError(
                    f"{name} cannot be sent to the decode processes: {type(e).__name__}: {e}. "
                    "It (or what it refers to) holds something that cannot be pickled, such "
                    "as an open file, a lock or a socket; or use num_workers=0."
                ) from e
        return pickled

    # -- epochs and state ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of `epoch` (its order depends on it). After
        `load_state_dict`, setting the saved epoch keeps the saved position, as a training loop
        that resumes and then calls `set_epoch(epoch)` for each epoch expects."""
        _check_count("epoch", epoch, minimum=0)
        resuming = self._resume_at is not None and epoch == self._epoch
        if not resuming:
            self._epoch, self._position, self._resume_at, self._remaining = epoch, 0, None, None

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: small and JSON-serialisable, and the same on every rank.

        Map-style data: the position in the epoch's global order. Streams divided by samples
        (`TarShards`, `Parquet`): the positions of the epoch's sequence no rank has taken yet.
        Both resume any rank at any world size. Other streams: the items this rank handed
        over, and the world size, which a resumed stream must keep.
        """
        running = self._pass
        position = running.position if running is not None else self._position
        state: dict[str, Any] = {"epoch": self._epoch, "position": position}
        if isinstance(self.dataset, IndexedStream):
            info = self._shard_info(self._epoch, self._remaining)
            remaining = self.dataset.state_after(info, position)
            total = int(self.dataset.unit_sizes.sum())
            state["position"] = total - sum(end - start for start, end in remaining)
            state["remaining"] = [list(pair) for pair in remaining]
        elif isinstance(self.dataset, Stream):
            state["world_size"] = self.world_size
        state_at = getattr(self.dataset, "state_at", None)
        if state_at is not None:  # a mixture: where each source stands, for people to read
            state["sources"] = state_at(self._epoch, self.seed, position)
        fingerprint = getattr(self.dataset, "fingerprint", None)
        if fingerprint is not None:  # a mixture: its sources, weights and lengths
            state["mixture"] = fingerprint()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues the saved epoch at the saved position. A state that
        does not fit this data (a position past the epoch, another world size for a stream
        that needs the same) is refused here, naming what is wrong."""
        epoch, position = _check_state(state)
        check_state = getattr(self.dataset, "check_state", None)
        if check_state is not None:  # a mixture: the same sources, weights and lengths
            check_state(state)
        remaining = None
        if isinstance(self.dataset, IndexedStream):
            total = int(self.dataset.unit_sizes.sum())
            if "remaining" in state:
                remaining = check_intervals(state["remaining"], total)
            elif state.get("world_size") is not None:  # saved per rank by an older version
                saved = ShardInfo(0, int(state["world_size"]), epoch, self.seed, self.shuffle,
                                  self.drop_last)
                remaining = self.dataset.state_after(saved, position)
        elif isinstance(self.dataset, Stream):
            if state.get("world_size") != self.world_size:
                raise LoaderError(
                    f"this stream's state was saved with world size {state.get('world_size')}; "
                    f"a stream resumes only with the same world size, not {self.world_size}"
                )
            if isinstance(self.dataset, Sized) and position > len(self.dataset):
                raise ValueError(f"position {position} is past this rank's "
                                 f"{len(self.dataset)} items")
        elif position > len(self.dataset):
            raise ValueError(f"position {position} is past the end of the epoch "
                             f"({len(self.dataset)} samples)")
        if remaining is not None:  # the new division starts with nothing taken
            position = 0
        self._epoch, self._position, self._remaining = epoch, position, remaining
        self._resume_at = position

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

    def _shard_info(self, epoch: int, remaining: Intervals | None = None) -> ShardInfo:
        return ShardInfo(self.rank, self.world_size, epoch, self.seed, self.shuffle,
                         self.drop_last, remaining, self.memory_limit // 2)

    def _steps_per_chunk(self) -> int:
        return 1 if self.batch_size else UNBATCHED_CHUNK

    def _prefetch_chunks(self) -> int:
        return -(-self.prefetch // self._steps_per_chunk())

    def _decode_window(self) -> int:
        """Chunks decoding or finished and waiting: enough for every decode process to have
        one running and one queued, plus the prefetch."""
        return self._prefetch_chunks() + 2 * max(self.num_workers, 1) + 1

    # -- passes -----------------------------------------------------------------------------

    def _config(self, epoch: int) -> PassConfig:
        chunk_samples = (self.batch_size or 1) * self._steps_per_chunk()
        reads = autotune.HIGHEST if self.auto_concurrency else self.concurrency
        return PassConfig(
            epoch=epoch,
            batch_size=self.batch_size,
            steps_per_chunk=self._steps_per_chunk(),
            ordered=self.ordered,
            skip_errors=self.on_error == "skip",
            memory_limit=self.memory_limit,
            read_ahead=max(READ_AHEAD_PER_READ * reads, 2 * chunk_samples),
            decode_window=self._decode_window(),
            stall_timeout=self.stall_timeout,
        )

    async def _open_pass(self) -> Pass:
        self._holder.check_process()
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            if self._pass is not None or self._opening:
                raise LoaderError(
                    "a pass over this Loader is already running (in another thread or task); "
                    "a Loader runs one pass at a time: finish or break that loop first"
                )
            self._opening = True
        try:
            running = await self._build_pass()
            try:
                await running.start()
            except BaseException:
                await running.aclose()
                raise
        finally:
            with self._lock:
                self._opening = False
        with self._lock:
            self._pass, self._pass_loop = running, asyncio.get_running_loop()
            if self._closed:  # closed while the pass was being built
                running.fail(LoaderError("the Loader was closed"))
        return running

    async def _build_pass(self) -> Pass:
        start = self._resume_at or 0
        if self._resume_at is None:
            self._remaining = None
        self._position, self._resume_at = start, None
        epoch = self._epoch
        config = self._config(epoch)
        stats = self.stats
        # a stream is pulled one item at a time, whatever it reads ahead itself
        stats.concurrency = 1 if isinstance(self.dataset, Stream) else self.concurrency
        stats.stream = isinstance(self.dataset, Stream)
        stats.decode_processes = self.num_workers
        reads = autotune.ReadLimit(self.concurrency)
        connections = autotune.HIGHEST if self.auto_concurrency else self.concurrency
        storage = Storage(connections, self.retries, self.timeout, stats.storage,
                          self.disk_cache, self.max_object_bytes, self._hedger or False)
        source: PlannedSource | StreamSource
        if isinstance(self.dataset, Stream):
            source = StreamSource(
                self.dataset, start, self.batch_size or 1,
                config.steps_per_chunk, not (self.drop_last and self.batch_size), stats,
            )
        else:
            order = self.dataset.epoch_order(self.shuffle, self.seed, epoch)
            plan = EpochPlan(order, self.batch_size or 1, self.rank, self.world_size,
                             self.drop_last, start)
            source = PlannedSource(self.dataset, plan, config.steps_per_chunk,
                                   config.skip_errors, self.cache, reads, stats)
        decoder = self._decoder(epoch)
        side_tasks = []
        if self.auto_concurrency:
            tuner = autotune.Tuner(
                reads,
                lambda: (stats.fetch.count, stats.fetch.total, stats.consumer_wait.total),
                self._use_concurrency,
            )
            side_tasks.append(tuner.tune())
        info = self._shard_info(epoch, self._remaining)

        def in_context(start_task: Callable[[], asyncio.Task[None]]) -> asyncio.Task[None]:
            """The feed and the tasks it starts see this pass's storage and shard info."""

            def start_with_storage() -> asyncio.Task[None]:
                with storage.as_current():
                    return start_task()

            return call_with_shard_info(info, start_with_storage)

        return Pass(config, source, decoder, self._blocks, stats, storage, in_context,
                    side_tasks)

    def _decoder(self, epoch: int) -> Decoder:
        if self.executor is not None:
            return ExecutorDecoder(self._spec, self.executor)
        if not self.num_workers or self._nothing_to_decode():
            return InlineDecoder(self._spec)
        base_seed = int(
            np.random.SeedSequence([self.seed, epoch], spawn_key=(Spawn.WORKER_SEEDS,))
            .generate_state(1)[0]
        )

        def get_pool() -> DecodePool:
            if self.persistent_workers:
                return self._holder.get(self, base_seed)
            return DecodePool(self._spec, self.num_workers, base_seed, self._worker_init)

        return PoolDecoder(get_pool, not self.persistent_workers, self.decode_timeout,
                           self.max_worker_restarts, self.on_error == "skip",
                           self._worker_restarted, on_timeout=self._decode_timed_out)

    def _nothing_to_decode(self) -> bool:
        """No decode, no augment, no cache, nothing read in the workers, the default collate
        and no worker_init: sending raw items to a process and back would cost more than
        collating them here."""
        spec = self._spec
        return (spec.passes_through and spec.collate in (None, default_collate)
                and self._worker_init is None)

    def _use_concurrency(self, limit: int) -> None:
        self.concurrency = self.stats.concurrency = limit

    def _decode_timed_out(self) -> None:
        self.stats.decode_timeouts += 1

    def _worker_restarted(self, message: str) -> None:
        self.stats.worker_restarts += 1
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _pass_over(self, running: Pass) -> None:
        """Book-keeping once a pass is closed or dropped: epoch, position, the running slot."""
        with self._lock:
            if self._pass is not running:
                return
            if running.finished:
                self._epoch, self._position, self._remaining = self._epoch + 1, 0, None
            else:
                self._position = running.position
            self._pass = self._pass_loop = None
            self._pass_ended.notify_all()

    async def _close_pass(self, running: Pass) -> None:
        try:
            await running.aclose()
        finally:
            self._pass_over(running)

    def _abandon_pass(self, running: Pass) -> None:
        running.abandon()
        self._pass_over(running)

    def __aiter__(self) -> AsyncIterator[Any]:
        return _AsyncPass(self)

    def __iter__(self) -> Iterator[Any]:
        loop = LoopThread()
        try:
            running = loop.call(self._open_pass())
            try:
                while (item := loop.call(running.next())) is not END:
                    yield item
            finally:
                if loop.alive():  # not so for an iterator collected at interpreter exit
                    loop.call(self._close_pass(running))
        finally:
            loop.stop()

    def timeline(self, path: str | Path) -> Path:
        """Draw what the loader did (the most recent events) as a PNG at `path`; needs
        matplotlib. Reads overlap in the fetch row: darker means more in flight."""
        from ._tools.timeline import draw

        return draw(self.stats.events, path, title=self.stats.verdict())

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the decode processes and unlink the shared memory; idempotent, from any
        thread. A pass in progress raises LoaderError; batches handed over stay valid."""
        with self._lock:
            self._closed = True
            running, loop = self._pass, self._pass_loop
        if running is not None and loop is not None:
            error = LoaderError("the Loader was closed while a pass was running")
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(running.fail, error)
            if not _in_loop(loop) and not self._holder.foreign:  # a fork's pass is the parent's
                with self._lock:
                    self._pass_ended.wait_for(lambda: self._pass is not running,
                                              CLOSE_WAIT_SECONDS)
        self._finalizer()

    async def aclose(self) -> None:
        """close() for async code: a pass running in this loop is closed here, and the decode
        processes are stopped and joined on another thread, never blocking the loop."""
        with self._lock:
            running, loop = self._pass, self._pass_loop
        if running is not None and loop is asyncio.get_running_loop():
            running.fail(LoaderError("the Loader was closed while a pass was running"))
            await self._close_pass(running)
        await off_loop(self.close)


def _start_zygote(packages: list[str]) -> None:
    with contextlib.suppress(Exception):  # a failure shows, with its cause, at the first pass
        Zygote.get().preload(packages)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    with contextlib.suppress(RuntimeError):
        return asyncio.get_running_loop() is loop
    return False


class _AsyncPass:
    """`async for` over a Loader. Dropping it mid-pass (a `break`) releases the pass at once,
    so the next `async for` starts cleanly even before the old one is finalized."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._pass: Pass | None = None
        self._done = False

    def __aiter__(self) -> _AsyncPass:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        if self._pass is None:
            self._pass = await self._loader._open_pass()
        try:
            item = await self._pass.next()
        except BaseException:
            await self.aclose()
            raise
        if item is END:
            await self.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        if self._pass is not None and not self._done:
            self._done = True
            await asyncio.shield(self._loader._close_pass(self._pass))

    def __del__(self) -> None:
        if self._pass is not None and not self._done:
            self._done = True
            self._loader._abandon_pass(self._pass)


def _shut_down(holder: _PoolHolder, blocks: BlockPool | None) -> None:
    """Processes first: none may create a block after the blocks are removed. In a forked
    child (its `sys.exit` runs this finalizer too) the processes and blocks are the parent's:
    only the child's copies are let go of."""
    holder.close()
    if blocks is not None:
        blocks.close()


class _PoolHolder(ProcessBound):
    """The loader's persistent decode pool, built on first use; kept apart from the Loader so
    a finalizer can close it."""

    def __init__(self) -> None:
        super().__init__()
        self._pool: DecodePool | None = None
        self._lock = threading.Lock()

    def check_process(self) -> None:
        """LoaderError in a child forked from the loader's process: what it would use is the
        parent's."""
        if self.foreign:
            raise LoaderError(
                f"this Loader was built in process {self.owner_pid}, and process {os.getpid()} "
                "is a child forked from it: its decode processes and shared memory are the "
                "parent's. Build a new Loader in the child."
            )

    def get(self, loader: Loader, base_seed: int) -> DecodePool:
        self.check_process()
        with self._lock:
            if self._pool is None:
                self._pool = DecodePool(
                    loader._spec, loader.num_workers, base_seed, loader._worker_init
                )
            return self._pool

    def close(self) -> None:
        if self.foreign:  # no lock: a thread of the parent may have held it at the fork
            pool, self._pool = self._pool, None
        else:
            with self._lock:
                pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _check_count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_state(state: Any) -> tuple[int, int]:
    """The epoch and position of a saved state, or a ValueError naming what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"a loader state is the dict state_dict() gave, got {state!r}")
    for key in ("epoch", "position"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"the state's {key!r} must be an integer >= 0, got {value!r} "
                             f"(in {state!r})")
    return int(state["epoch"]), int(state["position"])


def _check_seconds(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < math.inf
    ):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
