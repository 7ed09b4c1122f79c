"""The decode process pool: start method, worker ids and seeds, running decode on chunks.

A chunk is the unit sent to a process: the raw items of one batch (or of a few unbatched
samples). Decoding and collating a whole batch in one task keeps the pipe traffic to one
message each way per batch, whatever the batch size.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import pickle
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import numpy as np

from .._cache import CachedSample, SharedCache
from .._collate import default_collate
from .._errors import WorkerDiedError
from .._sampling import sample_rng
from .._stats import now
from . import transport

CLOSE_GRACE_SECONDS = 2.0
"""How long close() lets a busy decode process finish before it is killed."""


@dataclass(frozen=True)
class WorkerInfo:
    """What `get_worker_info()` tells code running in a decode process."""

    id: int
    num_workers: int
    seed: int


_worker_info: WorkerInfo | None = None
_spec: DecodeSpec | None = None


def get_worker_info() -> WorkerInfo | None:
    """Inside decode: this process's id, the number of decode processes and its seed.

    None in the main process (also when num_workers=0 decodes inline).
    """
    return _worker_info


@dataclass(frozen=True)
class DecodeSpec:
    """Everything a decode process needs, sent once when it starts."""

    decode: Callable[..., Any] | None
    collate: Callable[[list[Any]], Any] | None
    """None: deliver samples one by one instead of a batch."""
    skip_errors: bool
    seed: int
    augment: Callable[..., Any] | None = None
    """The random step after a cached decode: augment(value) or augment(value, rng)."""
    cache: SharedCache | None = None
    wants_rng: bool = field(init=False)
    augment_wants_rng: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wants_rng", takes_rng(self.decode))
        object.__setattr__(self, "augment_wants_rng", takes_rng(self.augment))

    def sample(self, epoch: int, index: int, raw: Any) -> Any:
        """Decode (or take from the cache), then augment: one sample, as the loader gives it."""
        if isinstance(raw, CachedSample):
            assert self.cache is not None
            value = self.cache.get(index)
        else:
            if self.decode is None:
                value = raw
            elif self.wants_rng:
                value = self.decode(raw, sample_rng(self.seed, epoch, index))
            else:
                value = self.decode(raw)
            if self.cache is not None:
                self.cache.put(index, value)
        if self.augment is None:
            return value
        if self.augment_wants_rng:
            return self.augment(value, sample_rng(self.seed, epoch, index))
        return self.augment(value)


@dataclass
class Chunk:
    epoch: int
    indices: list[int]
    raws: list[Any]
    slot: transport.Slot | None = None
    """A shared-memory block to hand the result back in, when the main process has one."""


@dataclass
class ChunkResult:
    items: list[Any]
    """One collated batch, nothing if every sample was skipped, or the samples when unbatched."""
    skipped: list[tuple[int, str]]
    """(position in the chunk, traceback) of samples whose decode raised, on_error="skip"."""
    failure: tuple[int | None, str] | None = None
    """(index, traceback) of the first failure with on_error="raise"; index None: collate."""
    timings: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each decoded sample, on the clock of `stats.now`."""
    process: str = "inline"
    """Which decode process ran the chunk, for the timeline."""
    shared: bool = False
    """The items' arrays are in the chunk's slot (SharedArray places in `items`)."""
    needed: int = 0
    """Bytes the items' arrays need in shared memory."""


def takes_rng(decode: Callable[..., Any] | None) -> bool:
    """True when decode accepts a second positional argument (with or without a default)."""
    if decode is None:
        return False
    try:
        parameters = inspect.signature(decode).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in positional)


def run_chunk(
    spec: DecodeSpec, chunk: Chunk, allocate: transport.BlockAllocator | None = None
) -> ChunkResult:
    """Decode every raw item of a chunk, then collate them (into `allocate`'s shared memory
    when given and the collate is the default one); errors become data, not raises."""
    info = _worker_info
    result = ChunkResult([], [], process="inline" if info is None else f"decode {info.id}")
    samples: list[Any] = []
    for position, (index, raw) in enumerate(zip(chunk.indices, chunk.raws, strict=True)):
        started = now()
        try:
            samples.append(spec.sample(chunk.epoch, index, raw))
        except Exception:
            if not spec.skip_errors:
                result.failure = (index, traceback.format_exc())
                return result
            result.skipped.append((position, traceback.format_exc()))
            continue
        result.timings.append((started, now()))
    if spec.collate is None or not samples:
        result.items = samples
        return result
    try:
        if allocate is not None and spec.collate is default_collate:
            try:
                result.items = [default_collate(samples, allocate)]
                return result
            except transport.NoRoom:
                allocate.used = 0  # too big for this block: collate as usual, say so
        result.items = [spec.collate(samples)]
    except Exception:
        result.failure = (None, traceback.format_exc())
    return result


def _run_in_worker(chunk: Chunk) -> ChunkResult:
    assert _spec is not None, "decode process was not initialised"
    slot = chunk.slot
    allocate = transport.BlockAllocator(slot) if slot is not None and slot.size else None
    result = run_chunk(_spec, chunk, allocate)
    if allocate is not None and allocate.used and result.failure is None:
        result.items = allocate.places(result.items)  # collated straight into the block
        result.needed, result.shared = allocate.used, True
    elif result.items and result.failure is None:
        result.needed = transport.shared_bytes(result.items)
        big = result.needed >= transport.SMALL_RESULT
        if slot is not None and big and transport.fits(slot, result.needed):
            result.items = transport.write(result.items, slot, result.needed)
            result.shared = True
    return result


def _warm_up() -> None:
    """A no-op task; submitting one per worker starts every process at once."""


def _init_worker(
    spec: DecodeSpec,
    num_workers: int,
    base_seed: int,
    next_id: Synchronized[int],
    worker_init: Callable[[int], Any] | None,
) -> None:
    global _worker_info, _spec
    with next_id.get_lock():
        worker_id = next_id.value
        next_id.value += 1
    seed = base_seed + worker_id
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    _worker_info = WorkerInfo(worker_id, num_workers, seed)
    _spec = spec
    if worker_init is not None:
        worker_init(worker_id)


def check_picklable(name: str, value: object) -> None:
    """Fail at construction, not in a worker, when a function cannot reach the processes."""
    try:
        pickle.dumps(value)
    except Exception as e:
        raise ValueError(
            f"{name}={value!r} cannot be sent to the decode processes ({e}). Define it at module "
            "level (not a lambda or a nested function); in a script, keep the loop under "
            "`if __name__ == '__main__':`. Or use num_workers=0 to decode in this process."
        ) from e


def start_method() -> str:
    """forkserver where it exists (Linux): never plain fork, since a loop thread may be running."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods and sys.platform == "linux" else "spawn"


def process_context() -> multiprocessing.context.BaseContext:
    """The start method's context; a forkserver preloads this module (and numpy) once, so each
    decode process starts in milliseconds instead of re-importing them (about 0.25 s here).
    The preload only takes effect if the forkserver is not running yet."""
    context = multiprocessing.get_context(start_method())
    if isinstance(context, multiprocessing.context.ForkServerContext):
        context.set_forkserver_preload(["__main__", __name__])
    return context


class DecodePool:
    """Runs chunks in `num_workers` processes, or inline when num_workers is 0."""

    def __init__(
        self,
        spec: DecodeSpec,
        num_workers: int,
        base_seed: int,
        worker_init: Callable[[int], Any] | None,
    ) -> None:
        self._spec = spec
        self.num_workers = num_workers
        self._executor: ProcessPoolExecutor | None = None
        if num_workers:
            context = process_context()
            self._executor = ProcessPoolExecutor(
                num_workers,
                mp_context=context,
                initializer=_init_worker,
                initargs=(spec, num_workers, base_seed, context.Value("i", 0), worker_init),
            )
            for _ in range(num_workers):  # processes start on demand: ask for all of them now
                self._executor.submit(_warm_up)

    @property
    def broken(self) -> bool:
        return self._executor is not None and bool(getattr(self._executor, "_broken", False))

    async def run(self, chunk: Chunk) -> ChunkResult:
        if self._executor is None:
            return run_chunk(self._spec, chunk)
        try:
            return await asyncio.wrap_future(self._executor.submit(_run_in_worker, chunk))
        except BrokenProcessPool as e:
            raise WorkerDiedError(
                f"a decode process ended abruptly ({self._exit_report()}) while decoding samples "
                f"{_short_list(chunk.indices)}; the OOM killer or a crash in native code are "
                f"the usual causes. Original error: {e}"
            ) from e

    def _exit_report(self) -> str:
        processes = (getattr(self._executor, "_processes", None) or {}).values()
        codes = {p.exitcode for p in processes if p.exitcode is not None}
        # the pool sends SIGTERM to the survivors once one dies: name the first cause
        causes = codes - {-signal.SIGTERM} or codes
        return ", ".join(_describe_exit(c) for c in sorted(causes)) or "exit status unknown"

    def close(self) -> None:
        """Stop the processes: idle ones exit at once, busy ones get a grace period, then a kill."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = list((getattr(executor, "_processes", None) or {}).values())
        executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + CLOSE_GRACE_SECONDS
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(CLOSE_GRACE_SECONDS)
        manager = getattr(executor, "_executor_manager_thread", None)
        if manager is not None:
            manager.join(CLOSE_GRACE_SECONDS)


class ExecutorPool:
    """Decoding on an executor the caller owns (for example a Dask cluster's): the spec travels
    with each task, since there is no initializer to send it once; the executor stays open."""

    broken = False

    def __init__(self, spec: DecodeSpec, executor: Executor) -> None:
        self._spec = spec
        self._executor = executor

    async def run(self, chunk: Chunk) -> ChunkResult:
        return await asyncio.wrap_future(self._executor.submit(run_chunk, self._spec, chunk))

    def close(self) -> None:
        """Nothing to stop: the executor belongs to the caller."""


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _short_list(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}{', ...' if len(values) > limit else ''}]"
