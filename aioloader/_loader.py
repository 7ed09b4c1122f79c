"""The Loader: a front over its configuration (`LoaderConfig`), the decode pool it keeps, and
where it stands in the epochs.

Each iteration is a pass (`_pass.pipeline.Pass`) built from the configuration, in a loader
service (`_service`: the default with decode processes; here only the client's side) or in the
event loop that iterates: the caller's for `async for`, a loop in a background thread for a
plain `for`. A Loader runs one pass at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sized
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from . import _reaper as reaper
from ._blocking import off_loop
from ._cache import SharedCache
from ._closing import AsyncClosing, Closing
from ._collate import default_collate
from ._config import DEFAULT_MEMORY_LIMIT, LoaderConfig, Service, check_count, default_service
from ._datasets import Dataset, Stream
from ._datasets.indexed import IndexedStream
from ._datasets.torchiter import FromTorchIterable
from ._errors import LoaderError
from ._iteration.handles import AsyncIteration, Iteration
from ._iteration.runner import Position, Runner
from ._pass import autotune
from ._pass.factory import PassFactory
from ._sampling import (
    ShardInfo,
    call_with_shard_info,
    check_intervals,
    default_rank_and_world_size,
    steps_in_epoch,
)
from ._service.holder import ServiceHolder
from ._stats import LoaderStats
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
        shared_memory: hand large batches back through shared memory instead of pickles.
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
        _warn_if_more_workers_than_cpus(config.num_workers)
        self._factory = factory = PassFactory(config, executor)
        self._service = service = ServiceHolder()
        if config.num_workers and executor is None:
            service.prepare(config, factory.spec)
        self._runner = Runner(factory, service)
        self._finalizer = reaper.Shutdown(self, functools.partial(_shut_down, factory, service))

    # -- settings (read-only: `config` holds them all) ---------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        """Settings are fixed when the Loader is built (its processes and service took them):
        setting one later raises, as DataLoader's does (ValueError), rather than changing
        nothing; also an AttributeError, as for any read-only attribute."""
        if name in _SETTINGS and "config" in self.__dict__:
            raise _FixedSetting(
                f"{name} cannot be set once the Loader is built: its settings are fixed. Build "
                f"another: Loader.from_config(dataclasses.replace(loader.config, {name}=...))")
        super().__setattr__(name, value)

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
        return self._service.stats(self._factory.stats)

    def start(self) -> None:
        """Start now what the first pass would otherwise start and wait for, and return once
        it is ready: the loader service (a node's: joined) and, with `persistent_workers`, the
        decode processes, each with decode's modules imported and `worker_init` run. The first
        epoch then pays for none of it: a job whose ranks wait for each other at every step,
        a benchmark that times epochs. Optional: a pass starts them anyway. Blocking (from
        `async` code: `await asyncio.to_thread(loader.start)`), each wait bounded. A
        decode process that fails to start is reported by the first pass, as without it."""
        self._runner.start()

    # -- epochs and state ------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._runner.at.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next iteration at the beginning of `epoch` (its order depends on it). After
        `load_state_dict`, setting the saved epoch keeps the saved position, as a training loop
        that resumes and then calls `set_epoch(epoch)` for each epoch expects."""
        check_count("epoch", epoch, minimum=0)
        self._runner.move(self._runner.at.at_epoch(epoch))

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: small and JSON-serialisable, and the same on every rank.

        Map-style data: the position in the epoch's global order. Streams divided by samples
        (`TarShards`, `Parquet`): the positions of the epoch's sequence no rank has taken yet.
        Both resume any rank at any world size. Other streams: the items this rank handed
        over, and the world size, which a resumed stream must keep.

        It describes the running pass where it stands, else the next: once a pass ends,
        finished or broken off, that is the next epoch's start. To resume mid-epoch, take it
        inside the loop, before a `break`.
        """
        at, position = self._runner.at, self._runner.position
        state: dict[str, Any] = {"epoch": at.epoch, "position": position}
        if isinstance(self.dataset, IndexedStream):
            info = self._factory.shard_info(at.epoch, at.remaining)
            remaining = self.dataset.state_after(info, position)
            total = int(self.dataset.unit_sizes.sum())
            state["position"] = total - sum(end - start for start, end in remaining)
            state["remaining"] = [list(pair) for pair in remaining]
        elif isinstance(self.dataset, Stream):
            state["world_size"] = self.world_size
            copies = self._runner.copies
            if copies is not None:  # an IterableDataset: where each worker's copy stands
                state["copies"] = copies
        state_at = getattr(self.dataset, "state_at", None)
        if state_at is not None:  # a mixture: where each source stands, for people to read
            state["sources"] = state_at(at.epoch, self.config.seed, position)
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
        remaining, copies = None, None
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
            if isinstance(self.dataset, FromTorchIterable) and position:
                copies = _check_copies(state.get("copies"), max(self.num_workers, 1))
            if state.get("world_size") != self.world_size:
                raise LoaderError(
                    f"this stream's state was saved with world size {state.get('world_size')}; "
                    f"a stream resumes only with the same world size, not {self.world_size}"
                )
            if copies is None and isinstance(self.dataset, Sized) and position > len(self.dataset):
                raise ValueError(f"position {position} is past this rank's "
                                 f"{len(self.dataset)} items")
        elif position > len(self.dataset):
            raise ValueError(f"position {position} is past the end of the epoch "
                             f"({len(self.dataset)} samples)")
        if remaining is not None:  # the new division starts with nothing taken
            position = 0
        self._runner.move(Position(epoch, position, position, remaining, copies))

    def __len__(self) -> int:
        """Batches this rank gets in the next pass (in the running one, while it runs):
        after `load_state_dict`, those of the resumed pass, as progress bars and schedulers
        need (samples when batch_size is None)."""
        step, at = self.batch_size or 1, self._runner.at
        if not isinstance(self.dataset, Stream):
            return steps_in_epoch(len(self.dataset) - at.start, step, self.world_size,
                                  self.config.drop_last)
        if not hasattr(self.dataset, "__len__"):
            raise TypeError("this Loader reads a Stream without __len__: its length is unknown")
        dataset = cast(Sized, self.dataset)
        info = self._factory.shard_info(at.epoch, at.remaining)
        items = call_with_shard_info(info, lambda: len(dataset)) - at.start
        return items // step if self.config.drop_last else -(-items // step)

    def __iter__(self) -> Iterator[Any]:
        return Iteration(self, self._runner.open)

    def __aiter__(self) -> AsyncIterator[Any]:
        return AsyncIteration(self, self._runner.open_async)

    def timeline(self, path: str | Path) -> Path:
        """Draw what the loader did (the most recent events) as a PNG at `path`; needs
        matplotlib. Reads overlap in the fetch row: darker means more in flight."""
        from ._tools.timeline import draw

        return draw(self.stats.events, path, title=self.stats.verdict())

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the decode processes and let go of the shared memory; idempotent, from any
        thread. A pass in progress raises LoaderError; batches handed over stay valid."""
        self._runner.close()
        self._finalizer()

    async def aclose(self) -> None:
        """close() for async code: a pass running in this loop is closed in it, and the decode
        processes are stopped and joined on another thread, never blocking the loop."""
        await off_loop(self.close)


class _FixedSetting(ValueError, AttributeError):
    """A setting assigned after the Loader was built."""


_SETTINGS = frozenset({"config", *(field.name for field in dataclasses.fields(LoaderConfig))})
"""What `Loader.__setattr__` refuses to change once the Loader is built."""


def _warn_if_more_workers_than_cpus(num_workers: int) -> None:
    """As DataLoader warns: more decode processes than CPUs this process may use."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus and num_workers > cpus:
        warnings.warn(
            f"num_workers={num_workers} decode processes, but this process may use {cpus} "
            "CPUs: excessive worker creation might get the loader running slow or even freeze; "
            "lower num_workers (reads are not tied to it: concurrency= sets those)",
            UserWarning, stacklevel=4)


def _shut_down(factory: PassFactory, service: ServiceHolder) -> None:
    """The service first, then what the factory holds (processes before blocks). In a forked
    child (its `sys.exit` runs this too) only the child's copies are let go of."""
    service.close()
    factory.close()


def _check_copies(copies: Any, workers: int) -> dict[str, Any]:
    """Where an IterableDataset's copies stood, saved for as many decode processes as this
    Loader has (each copy resumes its own share), or an error naming what is wrong."""
    if not isinstance(copies, dict) or not isinstance(copies.get("workers"), list):
        raise LoaderError(
            "this IterableDataset's state has no 'copies' (where each worker's copy stood), "
            "so it resumes only at an epoch's start; save it with this version's state_dict()")
    saved = len(copies["workers"])
    if saved != workers:
        raise LoaderError(
            f"this IterableDataset's state was saved with {saved} decode processes; it resumes "
            f"with as many (each worker's copy resumes its own share), not {workers}")
    return copies


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
