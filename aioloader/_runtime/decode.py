"""Decoding a chunk: the spec a decode process runs, the per-sample rng, the collate into
shared memory, and `get_worker_info()` for code running in a decode process. Every decoder
(`decoders.py`) runs chunks through `run_chunk`, in a decode process or inline."""

from __future__ import annotations

import inspect
import re
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._cache import CachedSample, SharedCache
from .._collate import concatenate, default_collate
from .._sampling import sample_rng
from .._stats import now
from . import transport
from .messages import Chunk, ChunkResult


@dataclass(frozen=True)
class WorkerInfo:
    """What `get_worker_info()` tells code running in a decode process."""

    id: int
    num_workers: int
    seed: int


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """Inside decode: this process's id, the number of decode processes and its seed.

    None in the main process (also when num_workers=0 decodes inline).
    """
    return _worker_info


def set_worker_info(info: WorkerInfo) -> None:
    """Once, as a decode process starts: from then on it decodes as that worker."""
    global _worker_info
    _worker_info = info


_GENERATOR = re.compile(r"\bGenerator\b")


def takes_rng(function: Callable[..., Any] | None) -> bool:
    """True when the second positional parameter is named `rng` or annotated
    `numpy.random.Generator`: only then is the per-sample rng passed (`def f(raw, size=224)`
    keeps its default)."""
    if function is None:
        return False
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        return False
    second = positional[1]
    annotation = second.annotation
    if isinstance(annotation, str):
        return second.name == "rng" or bool(_GENERATOR.search(annotation))
    return second.name == "rng" or annotation is np.random.Generator


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
    load: Callable[[Any], Any] | None = None
    """Run on each raw item before decode, in this process: datasets read here (from_torch)."""
    threads: int = 1
    """Samples of a chunk loaded and decoded at once: blocking reads in `load` overlap."""
    wants_rng: bool = field(init=False)
    augment_wants_rng: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "wants_rng", takes_rng(self.decode))
        object.__setattr__(self, "augment_wants_rng", takes_rng(self.augment))

    @property
    def passes_through(self) -> bool:
        """Nothing to run per sample: raw items are the samples, only collated."""
        return (self.decode is None and self.augment is None and self.load is None
                and self.cache is None)

    def sample(self, epoch: int, index: int, raw: Any) -> Any:
        """Decode (or take from the cache), then augment: one sample, as the loader gives it."""
        if isinstance(raw, CachedSample):
            assert self.cache is not None
            value = self.cache.get(index)
        else:
            if self.load is not None:
                raw = self.load(raw)
            if self.decode is None:
                value = raw
            elif self.wants_rng:
                value = self.decode(raw, sample_rng(self.seed, epoch, index))
            else:
                value = self.decode(raw)
            if self.cache is not None:
                self.cache._put(index, value)
        if self.augment is None:
            return value
        if self.augment_wants_rng:
            return self.augment(value, sample_rng(self.seed, epoch, index))
        return self.augment(value)


def one_line(error: BaseException) -> str:
    """`Type: message`, first line only: what a skip reason or an error message shows."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def run_chunk(
    spec: DecodeSpec, chunk: Chunk, allocate: transport.BlockAllocator | None = None
) -> ChunkResult:
    """Decode every raw item of a chunk, then collate them (into `allocate`'s shared memory
    when given and the collate is the default one); errors become data, not raises."""
    info = _worker_info
    result = ChunkResult([], [], process="inline" if info is None else f"decode {info.id}")
    samples: list[Any] = list(chunk.raws) if spec.passes_through else []
    for position, outcome in enumerate([] if spec.passes_through else _outcomes(spec, chunk)):
        if isinstance(outcome, _Failure):
            if not spec.skip_errors:
                result.failure = (chunk.indices[position], outcome.reason, outcome.traceback)
                return result
            result.skipped.append((position, outcome.reason))
            continue
        sample, started, ended = outcome
        samples.append(sample)
        result.durations.append(ended - started)
        first, last = result.span or (started, ended)
        result.span = min(first, started), max(last, ended)
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
    except Exception as e:
        result.failure = (None, one_line(e), traceback.format_exc())
    return result


def join_results(results: list[ChunkResult], sizes: list[int],
                 allocate: transport.BlockAllocator | None = None) -> ChunkResult:
    """The results of consecutive parts of one chunk (of `sizes` samples each, collated by
    `default_collate`) as the one result of the whole chunk: its first failure, its skipped
    samples at their places in the chunk, one batch (its arrays from `allocate`, if given)."""
    joined = ChunkResult([], [], process=results[0].process)
    offset = 0
    for result, size in zip(results, sizes, strict=True):
        joined.skipped += [(offset + position, reason) for position, reason in result.skipped]
        if result.failure is not None and joined.failure is None:
            joined.failure = result.failure
        offset += size
    batches = [result.items[0] for result in results if result.items]
    if joined.failure is None and batches:
        try:
            joined.items = [_joined(batches, allocate)]
        except Exception as e:
            joined.failure = (None, one_line(e), traceback.format_exc())
    return joined


def _joined(batches: list[Any], allocate: transport.BlockAllocator | None) -> Any:
    """Into the block when it can hold the batch (parts of different dtypes join wider than
    their sum, and object arrays have no place in shared memory), else as usual."""
    if allocate is not None:
        try:
            return concatenate(batches, allocate)
        except Exception:
            allocate.used = 0
    return concatenate(batches)


@dataclass(frozen=True)
class _Failure:
    reason: str
    traceback: str


def _one(spec: DecodeSpec, epoch: int, index: int, raw: Any) -> tuple[Any, float, float] | _Failure:
    started = now()
    try:
        sample = spec.sample(epoch, index, raw)
    except Exception as e:
        return _Failure(one_line(e), traceback.format_exc())
    return sample, started, now()


_threads: ThreadPoolExecutor | None = None
"""A decode process's threads for `spec.threads` (one spec per process: made once)."""
_cheap: bool | None = None
"""Whether this process's samples take so little time that threads would only add switching:
decided on the first ones (CHEAP_SECONDS each, on average)."""
CHEAP_SECONDS = 0.001
TRIAL = 4


def _outcomes(spec: DecodeSpec, chunk: Chunk) -> list[tuple[Any, float, float] | _Failure]:
    """Each sample of the chunk, or why it failed; on `spec.threads` threads when more than
    one and samples are not cheap, so that blocking reads in `load` overlap (results keep the
    chunk's order)."""
    global _cheap
    jobs = list(zip(chunk.indices, chunk.raws, strict=True))

    def run(job: tuple[int, Any]) -> tuple[Any, float, float] | _Failure:
        return _one(spec, chunk.epoch, *job)

    if spec.threads <= 1 or len(jobs) <= 1 or _cheap:
        return [run(job) for job in jobs]
    if _worker_info is None:  # inline (num_workers=0): no thread outlives the chunk
        with ThreadPoolExecutor(spec.threads, thread_name_prefix="aioloader-load") as inline:
            return list(inline.map(run, jobs))
    done: list[tuple[Any, float, float] | _Failure] = []
    if _cheap is None:
        started = now()
        done = [run(job) for job in jobs[:TRIAL]]
        _cheap = (now() - started) / len(done) < CHEAP_SECONDS
        jobs = jobs[len(done):]
        if _cheap:
            return done + [run(job) for job in jobs]

    global _threads
    if _threads is None:
        _threads = ThreadPoolExecutor(spec.threads, thread_name_prefix="aioloader-load")
    return done + list(_threads.map(run, jobs))


def respond(spec: DecodeSpec, chunk: Chunk) -> ChunkResult:
    """Run a chunk in a decode process and put large results into the lent block."""
    slot = chunk.slot
    allocate = transport.BlockAllocator(slot) if slot is not None and slot.size else None
    result = run_chunk(spec, chunk, allocate)
    if allocate is not None and allocate.used and result.failure is None:
        result.items = allocate.places(result.items)  # collated straight into the block
        result.needed, result.shared = allocate.used, True
    elif result.items and result.failure is None:
        result.needed = transport.shared_bytes(result.items)
        if slot is not None and result.needed >= transport.SMALL_RESULT:
            try:
                placed = transport.write(result.items, slot, result.needed)
            except transport.NoSpace:
                result.no_space = True
            else:
                if placed is not None:
                    result.items, result.shared = placed, True
    return result
