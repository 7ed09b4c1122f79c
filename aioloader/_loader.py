"""The Loader: a front over its configuration (`LoaderConfig`), the decode pool it keeps, and
where it stands in the epochs.

Each iteration is a pass (`_runtime.passes.Pass`) built from the configuration, in a loader
service (`_service`: the default with decode processes; here only the client's side) or in the
event loop that iterates: the caller's for `async for`, a loop in a background thread for a
plain `for`. A Loader runs one pass at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sized
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from ._cache import SharedCache
from ._closing import AsyncClosing, Closing, ProcessBound
from ._collate import default_collate
from ._config import (
    DEFAULT_MEMORY_LIMIT,
    LoaderConfig,
    Service,
    check_count,
    default_service,
)
from ._datasets import Dataset, Stream
from ._datasets.indexed import IndexedStream
from ._errors import LoaderError
from ._loopthread import LoopThread
from ._runtime import autotune, node, reaper, shm
from ._runtime.blocking import off_loop
from ._runtime.channel import dumps
from ._runtime.factory import PassFactory
from ._runtime.fingerprint import fingerprint
from ._runtime.passes import END, Pass
from ._runtime.preload import packages_behind
from ._runtime.service_client import EXTRA_SECONDS, ServiceClient, load_stats
from ._runtime.zygote import Zygote
from ._sampling import (
    Intervals,
    ShardInfo,
    call_with_shard_info,
    check_intervals,
    default_rank_and_world_size,
    steps_in_epoch,
)
from ._stats import LoaderStats, now
from .storage._diskcache import DEFAULT_LIMIT as DEFAULT_DISK_CACHE_LIMIT
from .storage._diskcache import DiskCache
from .storage._limits import DEFAULT_MAX_OBJECT_BYTES
from .storage._retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT

CLOSE_WAIT_SECONDS = 5.0


class Loader(Closing, AsyncClosing):
    """Batches of decoded samples from a dataset, read with many reads in flight.

    Iterate it with `for` or `async for`; with decode processes the pipeline runs in a loader
    process of its own (`service`), else its event loop runs in a background thread (`for`)
    or in the running loop (`async for`); `with`/`async with` or `close()` stop everything it
    started.

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
        executor: where to decode instead of the built-in processes: a
            `concurrent.futures.Executor`, a Dask `distributed.Client`, or "ray" (the Ray
            this process holds, else the cluster RAY_ADDRESS names, else a local one started
            for this Loader, never one found running, and stopped when its last Loader
            closes; `num_workers` actors). An executor or client stays yours.
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
        service: "process" runs the passes (reads, decode scheduling, hand-over) in a loader
            process beside this one, so a training step holding the GIL does not slow them;
            batches arrive as views of shared memory. "node": one loader process for every
            rank of the node (torchrun's job) that builds the same Loader; `concurrency`,
            `num_workers` and `memory_limit` are then the node's. None keeps the event loop
            in this process. Default: "process" with decode processes, else None (pdb works).
    """

    def __init__(
        self,
        dataset: Dataset | Stream,
        decode: Callable[..., Any] | None = None,
        *,
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
        executor: Executor | Literal["ray"] | Any | None = None,
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
        service: Service | Literal["default"] | None = "default",
    ) -> None:
        default_rank, default_world = default_rank_and_world_size()
        config = LoaderConfig(
            dataset=dataset, decode=decode, batch_size=batch_size, shuffle=shuffle, seed=seed,
            drop_last=drop_last,
            concurrency=autotune.START if concurrency == "auto" else concurrency,
            auto_concurrency=concurrency == "auto", num_workers=num_workers, prefetch=prefetch,
            ordered=ordered, collate=collate, worker_init=worker_init,
            rank=default_rank if rank is None else rank,
            world_size=default_world if world_size is None else world_size,
            on_error=on_error, persistent_workers=persistent_workers, retries=retries,
            timeout=timeout, shared_memory=shared_memory, augment=augment, cache=cache,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            cache_limit=cache_limit, decode_timeout=decode_timeout, stall_timeout=stall_timeout,
            max_worker_restarts=max_worker_restarts,
            memory_limit=DEFAULT_MEMORY_LIMIT if memory_limit is None else memory_limit,
            max_object_bytes=max_object_bytes, hedge=hedge,
            service=default_service(num_workers, executor is not None)
            if service == "default" else service,
            has_executor=executor is not None,
        )
        self._start(config, executor)

    @classmethod
    def from_config(cls, config: LoaderConfig) -> Loader:
        """A Loader over a configuration made before."""
        loader = cls.__new__(cls)
        loader._start(config, None)
        return loader

    def _start(self, config: LoaderConfig, executor: object) -> None:
        self.config = config
        self._factory = factory = PassFactory(config, executor)
        self._service = _ServiceHolder()
        self._packages: list[str] = []
        if config.num_workers and executor is None:
            self._packages = packages = packages_behind(self._check_serialisable())
            # start the helper that forks decode processes now, with what decode imports, and
            # the loader service, while the caller builds the rest of the job: the first batch
            # need not wait for them (a node's service has its own helper)
            threading.Thread(target=_warm_up, args=(packages, self._service, config),
                             name="aioloader-warm-up", daemon=True).start()
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
        self._serving = False
        """A pass runs in the loader service."""
        self._dropped = False
        """The running pass's iterator was dropped; its release is on the way (a finalizer
        handed it over), and the next pass waits for it."""
        self._finalizer = reaper.Shutdown(self, functools.partial(
            _shut_down, factory, self._service))

    # -- settings (read-only: `config` holds them all) ---------------------------------------

    @property
    def dataset(self) -> Dataset | Stream:
        return self.config.dataset

    @property
    def batch_size(self) -> int | None:
        return self.config.batch_size

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    @property
    def prefetch(self) -> int:
        return self.config.prefetch

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def memory_limit(self) -> int:
        return self.config.memory_limit

    @property
    def disk_cache(self) -> DiskCache | None:
        """The folder of remote bytes kept on local disk (`cache_dir`), if any."""
        return self._factory.disk_cache

    @property
    def stats(self) -> LoaderStats:
        """Per-stage figures and the bottleneck verdict. With a loader service, the service's
        (asked for now while a pass runs), with the batches and waits seen here."""
        if self.config.service is None:
            return self._factory.stats
        return self._service.stats(self._factory.stats)

    def _check_serialisable(self) -> list[bytes]:
        """Fail here, not in a decode process or the service, when something cannot travel;
        the pickles. With a service, the configuration is all that travels from here (decode
        and worker_init inside it): it is pickled once, and the parts only to name the one
        that cannot."""
        if self.config.service is None:
            return self._pickled_for_decode()
        try:
            self._service.code = dumps(self.config)
            if self.config.service == "node":  # what every rank of the node computes alike
                self._service.fingerprint = fingerprint(
                    dataclasses.replace(self.config, rank=0, world_size=1))
        except Exception as e:
            self._pickled_for_decode()  # raises naming decode or worker_init when one is why
            raise ValueError(
                f"the dataset cannot be sent to the loader service: {type(e).__name__}: "
                f"{e}. It holds something that cannot be pickled (an open file, a lock, a "
                "client); make it picklable, or keep the loader in this process with "
                "service=None."
            ) from e
        return [self._service.code]

    def _pickled_for_decode(self) -> list[bytes]:
        pickled = []
        parts = (("decode", self._factory.spec), ("worker_init", self.config.worker_init))
        for name, value in parts:
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
        check_count("epoch", epoch, minimum=0)
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
            state["sources"] = state_at(self._epoch, self.config.seed, position)
        described = self.dataset.fingerprint()
        if described is not None:  # what the position means depends on: checked on load
            state["dataset"] = described
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration continues the saved epoch at the saved position. A state that
        does not fit this data (saved for other data, a position past the epoch, another world
        size for a stream that needs the same) is refused here, naming what is wrong."""
        epoch, position = _check_state(state)
        self.dataset.check_state(state)  # saved for this data: its length, units and sizes
        remaining = None
        if isinstance(self.dataset, IndexedStream):
            total = int(self.dataset.unit_sizes.sum())
            if "remaining" in state:
                remaining = check_intervals(state["remaining"], total)
            elif state.get("world_size") is not None:  # saved per rank by an older version
                config = self.config
                saved = ShardInfo(0, int(state["world_size"]), epoch, config.seed,
                                  config.shuffle, config.drop_last)
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
            return steps_in_epoch(len(self.dataset), step, self.world_size, self.config.drop_last)
        if not hasattr(self.dataset, "__len__"):
            raise TypeError("this Loader reads a Stream without __len__: its length is unknown")
        dataset = cast(Sized, self.dataset)
        items = call_with_shard_info(self._shard_info(self._epoch), lambda: len(dataset))
        return items // step if self.config.drop_last else -(-items // step)

    def _shard_info(self, epoch: int, remaining: Intervals | None = None) -> ShardInfo:
        return self._factory.shard_info(epoch, remaining)

    async def _open_pass(self) -> Pass:
        self._factory.pools.check_process()
        dropped = self._pass
        if self._dropped and dropped is not None and self._pass_loop is asyncio.get_running_loop():
            self._abandon_pass(dropped)  # its release, queued on this loop, has not run yet
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            self._refuse_a_second_pass()
            self._opening = True
        try:
            start = self._resume_at or 0
            if self._resume_at is None:
                self._remaining = None
            self._position, self._resume_at = start, None
            running = await self._factory.open(self._epoch, start, self._remaining)
        finally:
            with self._lock:
                self._opening = False
        with self._lock:
            self._pass, self._pass_loop = running, asyncio.get_running_loop()
            if self._closed:  # closed while the pass was being built
                running.fail(LoaderError("the Loader was closed"))
        return running

    def _refuse_a_second_pass(self) -> None:
        """Called holding the lock. A pass whose iterator was dropped is given a bounded wait
        for its release, which a finalizer handed to the reaper or the pass's loop."""
        if self._dropped:
            self._pass_ended.wait_for(lambda: not self._dropped, CLOSE_WAIT_SECONDS)
        if self._pass is not None or self._opening or self._serving:
            raise LoaderError(
                "a pass over this Loader is already running (in another thread or task); "
                "a Loader runs one pass at a time: finish or break that loop first"
            )

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
            self._dropped = False
            self._pass_ended.notify_all()

    async def _close_pass(self, running: Pass) -> None:
        try:
            await running.aclose()
        finally:
            self._pass_over(running)

    def _abandon_pass(self, running: Pass) -> None:
        try:
            running.abandon()
        finally:
            self._pass_over(running)

    def __aiter__(self) -> AsyncIterator[Any]:
        if self.config.service is not None:
            return _AsyncServicePass(self)
        return _AsyncPass(self)

    def __iter__(self) -> Iterator[Any]:
        if self.config.service is not None:
            return self._iter_service()
        return self._iter_here()

    def _iter_here(self) -> Iterator[Any]:
        loop, bound = LoopThread(), self.config.stall_timeout + EXTRA_SECONDS
        try:
            running = loop.call(self._open_pass(), bound, "new pass")
            try:
                while (item := loop.call(running.next(), bound, "batch")) is not END:
                    box, item = [item], None
                    yield box.pop()  # held by the trainer alone: `del batch` frees its block
            except BaseException:  # a failure, a `break`: that is what the caller sees
                if loop.alive():  # not so for an iterator collected at interpreter exit
                    with contextlib.suppress(LoaderError):
                        loop.call(self._close_pass(running), bound, "end of the pass")
                raise
            loop.call(self._close_pass(running), bound, "end of the pass")
        finally:
            loop.stop()
            del self  # a notebook keeps an interrupted pass's exception, and so this frame

    # -- passes in a loader service ------------------------------------------------------------

    def _iter_service(self) -> Iterator[Any]:
        client = self._open_service_pass()
        finished = False
        try:
            while True:
                asked = now()
                got = client.next()
                if got is None:
                    finished = True
                    return
                box, got = [self._served(got, asked)], None
                yield box.pop()  # held by the trainer alone: `del batch` frees its block
        finally:
            self._service_pass_over(client, finished)
            del self  # a notebook keeps an interrupted pass's exception, and so this frame

    def _open_service_pass(self) -> ServiceClient:
        """Start a pass in the service (started now if need be), where the loader stands."""
        self._factory.pools.check_process()
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            self._refuse_a_second_pass()
            self._serving = True
        try:
            client = self._service.get(self)
            start = self._resume_at or 0
            if self._resume_at is None:
                self._remaining = None
            client.open(self._epoch, start, self._remaining)
            self._position, self._resume_at = start, None
        except BaseException:
            with self._lock:
                self._serving = False
            raise
        return client

    def _served(self, got: tuple[Any, int], asked: float) -> Any:
        """Book a batch handed over: the position after it, the wait for it."""
        item, self._position = got
        stats, arrived = self._factory.stats, now()
        stats.batches += 1
        stats.consumer_wait.add(arrived - asked)
        stats.event("consumer", asked, arrived, "wait")
        return item

    def _service_pass_over(self, client: ServiceClient, finished: bool, wait: bool = True
                           ) -> None:
        """The pass ended, was broken off or failed: the service drops what it made ahead."""
        try:
            if not finished and client.pass_open and not client.closed:
                with contextlib.suppress(LoaderError):
                    client.stop(wait)
        finally:
            with self._lock:
                self._serving = self._dropped = False
                if finished:
                    self._epoch, self._position, self._remaining = self._epoch + 1, 0, None
                self._pass_ended.notify_all()

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
            if _in_loop(loop) or self._factory.pools.foreign:  # a fork's pass: the parent's
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(running.fail, error)
            else:  # closed here, in its loop: a suspended `for` need not come back for it
                with contextlib.suppress(RuntimeError, concurrent.futures.TimeoutError):
                    asyncio.run_coroutine_threadsafe(self._fail_pass(running, error), loop
                                                     ).result(CLOSE_WAIT_SECONDS)
        self._finalizer()

    async def _fail_pass(self, running: Pass, error: LoaderError) -> None:
        """The pass raises `error` at its next batch, and is closed now."""
        running.fail(error)
        await self._close_pass(running)

    async def aclose(self) -> None:
        """close() for async code: a pass running in this loop is closed here, and the decode
        processes are stopped and joined on another thread, never blocking the loop."""
        with self._lock:
            running, loop = self._pass, self._pass_loop
        if running is not None and loop is asyncio.get_running_loop():
            running.fail(LoaderError("the Loader was closed while a pass was running"))
            await self._close_pass(running)
        await off_loop(self.close)


def _warm_up(packages: list[str], service: _ServiceHolder, config: LoaderConfig) -> None:
    """Remove what killed jobs left in /dev/shm, then start the zygote with `packages`
    imported (a node's service has its own), then the loader service if there is one. Given
    the holder and the configuration, not the Loader: a Loader dropped meanwhile is finalized
    (closing what was started) rather than kept alive by this thread."""
    with contextlib.suppress(Exception):  # a failure shows, with its cause, at the first pass
        shm.sweep_dead()
        if config.service == "node":
            return
        Zygote.get().preload(packages)
        if config.service == "process":
            service.start(config, packages)


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
            del self  # a notebook keeps an interrupted cell's exception, and so this frame
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
        """A finalizer: the release goes to the pass's loop (docs/design.md, finalizers)."""
        if self._pass is not None and not self._done:
            self._done = True
            self._loader._dropped = True
            reaper.on_loop(self._pass.loop, self._loader._abandon_pass, self._pass)


class _AsyncServicePass:
    """`async for` over a Loader whose passes run in a loader service: the caller's loop
    awaits the service's socket."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._opened: list[ServiceClient] = []
        """The pass's client, put here by the thread that opens it: a caller cancelled
        meanwhile still stops it. A list, not a method of this object, goes to that thread,
        so that dropping this object (a `break`) ends the pass at once, not when the thread
        lets go of its work."""
        self._done = False

    def __aiter__(self) -> _AsyncServicePass:
        return self

    @property
    def _client(self) -> ServiceClient | None:
        return self._opened[0] if self._opened else None

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        if self._client is None:  # may start the service: off the loop
            await off_loop(_open_into, self._loader, self._opened)
        client = self._client
        assert client is not None
        asked = now()
        try:
            got = await client.next_async()
        except BaseException:
            await self.aclose()
            del self  # a notebook keeps an interrupted cell's exception, and so this frame
            raise
        if got is None:
            self._done = True
            self._loader._service_pass_over(client, finished=True)
            raise StopAsyncIteration
        return self._loader._served(got, asked)

    async def aclose(self) -> None:
        if self._client is not None and not self._done:
            self._done = True
            await off_loop(self._loader._service_pass_over, self._client, False)

    def __del__(self) -> None:
        """A finalizer: the stop goes to the reaper's thread (docs/design.md, finalizers)."""
        if self._client is not None and not self._done:
            self._done = True
            self._loader._dropped = True
            reaper.later(self._loader._service_pass_over, self._client, False, False)


def _open_into(loader: Loader, opened: list[ServiceClient]) -> None:
    opened.append(loader._open_service_pass())


def _shut_down(factory: PassFactory, service: _ServiceHolder) -> None:
    """The service first, then what the factory holds (processes before blocks). In a forked
    child (its `sys.exit` runs this too) only the child's copies are let go of."""
    service.close()
    factory.close()


class _ServiceHolder(ProcessBound):
    """A Loader's loader service, started on first use and kept until close; kept apart from
    the Loader so a finalizer can close it. A service found lost or cut off is replaced at the
    next pass."""

    def __init__(self) -> None:
        super().__init__()
        self.code = b""
        """The configuration, pickled when the Loader was built."""
        self.fingerprint = ""
        """For a node's service: what every rank with the same Loader computes alike."""
        self._client: ServiceClient | None = None
        self._last: bytes | None = None
        self._lock = threading.Lock()
        self._closed = False

    def get(self, loader: Loader) -> ServiceClient:
        return self.start(loader.config, loader._packages)

    def start(self, config: LoaderConfig, packages: list[str]) -> ServiceClient:
        """The service's client, the service started (again, if it was lost) if need be."""
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            if self._client is not None and self._client.broken is not None:
                self._client.close()
                self._client = None
            if self._client is None:
                self._client = node.connect(
                    self.code, self.fingerprint, packages, config.stall_timeout
                ) if config.service == "node" else ServiceClient.spawn(
                    self.code, packages, config.stall_timeout)
            return self._client

    def stats(self, here: LoaderStats) -> LoaderStats:
        """The service's stats (asked for while a pass runs, else as the last pass left them),
        with the batches handed over and the waits measured here."""
        client = self._client
        if client is not None:
            if client.pass_open and not client.closed:
                with contextlib.suppress(LoaderError):
                    self._last = client.stats()
            self._last = client.last_stats or self._last
        if self._last is None:
            return here
        merged = load_stats(self._last)
        merged.batches, merged.consumer_wait = here.batches, here.consumer_wait
        merged.raw_events = deque(
            sorted([e for e in merged.raw_events if e[0] != "consumer"] + list(here.raw_events),
                   key=lambda event: event[1]),
            maxlen=merged.raw_events.maxlen)
        return merged

    def close(self) -> None:
        """In a forked child, only its copy of the socket is let go of, without the lock (a
        thread of the parent may have held it at the fork)."""
        if self.foreign:
            client, self._client = self._client, None
        else:
            with self._lock:
                client, self._client, self._closed = self._client, None, True
        if client is not None:
            self._last = client.last_stats or self._last
            client.close()


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
