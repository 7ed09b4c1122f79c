"""Decoding a chunk: the spec a decode process runs, the per-sample rng, the collate into
shared memory, and `get_worker_info()` for code running in a decode process. Every decoder
(`decoders.py`) runs chunks through `run_chunk`, in a decode process or inline."""

from __future__ import annotations

import inspect
import itertools
import re
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._cache import CachedSample, SharedCache
from .._collate import (
    Stacked,
    by_field,
    check_same_shapes,
    concatenate,
    default_collate,
    scalar_dtype,
)
from .._errors import Exhausted, FetchError, type_name
from .._ipc import transport
from .._ipc.messages import Chunk, ChunkResult, Layout
from .._sampling import sample_rng
from .._stats import now


class WorkerInfo:
    """What `get_worker_info()` tells code running in a decode process: its id, the number of
    decode processes, its seed, and its copy of the dataset (`from_torch`'s; None for a
    dataset read in the event loop). Read-only, as DataLoader's: assigning raises
    RuntimeError."""

    __slots__ = ("dataset", "id", "num_workers", "seed")
    id: int
    num_workers: int
    seed: int
    dataset: Any

    def __init__(self, id: int, num_workers: int, seed: int, dataset: Any = None) -> None:
        for name, value in (("id", id), ("num_workers", num_workers), ("seed", seed),
                            ("dataset", dataset)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise RuntimeError(f"cannot assign attributes to {type(self).__name__} objects")

    def __repr__(self) -> str:
        return (f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
                f"dataset={type(self.dataset).__name__})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and all(
            getattr(self, name) == getattr(other, name) for name in self.__slots__)

    def __hash__(self) -> int:
        return hash((self.id, self.num_workers, self.seed))


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
    drop_partial: bool = False
    """An IterableDataset with drop_last: a chunk its worker's iterator ran out in is dropped
    if short, as DataLoader drops a worker's last, short batch."""
    snapshot: Callable[[Any], Any] | None = None
    """An IterableDataset: where this process's copy stands after a chunk, given the chunk's
    first raw item; sent back with the result, to resume from."""
    load_reads: bool = False
    """`load` reads the sample here (a local file, a record): what it raises is the sample's
    read failing, raised as a failed read with its own type, as the event loop's would be."""
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
                try:
                    raw = self.load(raw)
                except Exception as e:
                    if self.load_reads:
                        raise ReadFailed(e) from e
                    raise
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


def one_line(error: BaseException) -> str:
    """`Type: message`, first line only: what a skip reason or an error message shows."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def run_chunk(
    spec: DecodeSpec, chunk: Chunk, allocate: transport.BlockAllocator | None = None
) -> ChunkResult:
    """Decode every raw item of a chunk, then collate them (into `allocate`'s shared memory
    when given and the collate is the default one: row by row, as samples come); errors
    become data, not raises. An IterableDataset's copy says where it then stands."""
    result = _decoded(spec, chunk, allocate)
    if spec.snapshot is not None and chunk.raws:
        try:
            result.copy_state = spec.snapshot(chunk.raws[0])
        except Exception as e:
            error = RuntimeError(f"the dataset's state_dict raised {one_line(e)}")
            result.failure = result.failure or failure(None, error)
    return result


def _decoded(
    spec: DecodeSpec, chunk: Chunk, allocate: transport.BlockAllocator | None
) -> ChunkResult:
    info = _worker_info
    result = ChunkResult([], [], process="inline" if info is None else f"decode {info.id}")
    samples: list[Any] = list(chunk.raws) if spec.passes_through else []
    rows = (Rows(chunk, allocate)
            if allocate is not None and spec.collate is default_collate and not samples else None)
    position = -1  # counted here: enumerate's reused tuple would hold the last sample
    for outcome in [] if spec.passes_through else _outcomes(spec, chunk):
        position += 1
        if isinstance(outcome, _Exhausted):
            result.exhausted = True
            if spec.drop_partial:  # short of a batch: none
                samples, rows = [], None
                if allocate is not None:
                    allocate.discard()
            break
        if isinstance(outcome, _Failure):
            if outcome.error is not None:
                result.read_errors[chunk.indices[position]] = outcome.error
            if not spec.skip_errors:
                result.failure = (chunk.indices[position], outcome.reason, outcome.traceback,
                                  outcome.kind)
                return result
            result.skipped.append((position, outcome.reason))
            continue
        sample, started, ended = outcome
        result.durations.append(ended - started)
        first, last = result.span or (started, ended)
        result.span = min(first, started), max(last, ended)
        if rows is None:
            samples.append(sample)
            continue
        try:
            rows.add(sample)
        except (transport.NoRoom, transport.NoSpace) as e:  # the first sample: the block
            result.no_space = isinstance(e, transport.NoSpace)  # cannot hold the batch
            rows = None
            samples.append(sample)
        except Widened:  # collated as a list after all, to the wider dtype
            samples = [*rows.samples(), sample]
            rows = None
            assert allocate is not None
            allocate.discard()
        except Exception as e:
            result.failure = failure(None, e)
            return result
        del sample, outcome  # in its row now: not held while the next one is decoded
    try:
        if rows is not None:
            if chunk.rows and chunk.layout is None and rows.count:
                result.layout = rows.layout()
            result.items = [rows.batch()] if rows.count else []
            return result
        if spec.collate is None or not samples:
            result.items = samples
            return result
        if allocate is not None and spec.collate is default_collate and not chunk.rows:
            try:  # (a part's block holds the other parts' rows: never collated into)
                result.items = [default_collate(samples, allocate)]
                return result
            except transport.NoRoom:
                allocate.discard()  # too big for this block: collate as usual, say so
        result.items = [spec.collate(samples)]
    except Exception as e:
        result.failure = failure(None, e)
    return result


class Rows:
    """`default_collate` of samples given one at a time: each array of a sample is written
    into its row of a batch array in the lent block as the sample comes, so a decode process
    holds one decoded sample, not the chunk's (with samples of 50 MiB and batches of two, the
    batch's samples held beside its block were a third of what the loader used). Arrays are
    matched by their place in the sample (keys and positions), as collate matches them; the
    block is sized, or created, at the first sample. What is not an array (numbers, text) is
    collated at the end, around the rows.

    A part of a pass's first chunk (`chunk.rows`): the first part, one sample, makes the block
    with a row for every sample of the chunk and says where its arrays lie (`layout`); the
    others write their samples into their rows of that block, at those places. Their numbers
    and text stay in the heap, to be joined there."""

    def __init__(self, chunk: Chunk, allocate: transport.BlockAllocator) -> None:
        self._capacity = chunk.rows or len(chunk.indices)
        self._first_row = chunk.first_row
        self._given = dict(chunk.layout) if chunk.layout is not None else None
        self._part = bool(chunk.rows)
        self._allocate = allocate
        self._batches: dict[tuple[Any, ...], Stacked] = {}
        self._rests: list[Any] = []

    @property
    def count(self) -> int:
        return len(self._rests)

    def add(self, sample: Any) -> None:
        if not self._rests:
            self._open(sample)
        row = self._first_row + len(self._rests)

        def into_row(path: tuple[Any, ...], array: np.ndarray[Any, Any]) -> Stacked:
            stacked = self._batches.get(path)
            if stacked is None:
                raise ValueError("the samples of a batch must share one structure: an array "
                                 f"at {list(path)} is not in the first sample")
            check_same_shapes([stacked.batch[0], array])
            if np.result_type(stacked.batch, array) != stacked.batch.dtype:
                raise Widened  # collate would widen the batch's dtype: not in these rows
            np.copyto(stacked.batch[row, ...], array, casting="same_kind")
            return stacked

        self._rests.append(_arrays_by_place(sample, into_row))

    def _open(self, first: Any) -> None:
        """The block, for `capacity` rows of the first sample's arrays and numbers; or the
        places the layout given names in the lent block."""
        arrays: dict[tuple[Any, ...], np.ndarray[Any, Any]] = {}

        def note(path: tuple[Any, ...], array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            arrays[path] = array
            return array

        _arrays_by_place(first, note)
        if self._given is not None:
            if self._given.keys() != arrays.keys():
                theirs = [list(path) for path in self._given]
                raise ValueError("the samples of a batch must share one structure: arrays at "
                                 f"{[list(path) for path in arrays]}, not {theirs}")
            for path, place in self._given.items():
                self._batches[path] = Stacked(self._allocate.view(place))
            return
        numbers = 0 if self._part else _count_numbers(first)
        rows = self._capacity
        needed = (sum(transport.aligned(rows * a.nbytes) for a in arrays.values())
                  + numbers * transport.aligned(rows * 16))
        if needed < transport.SMALL_RESULT:
            raise transport.NoRoom  # small batches are pickled
        self._allocate.open(needed)
        for path, array in arrays.items():
            self._batches[path] = Stacked(self._allocate((rows, *array.shape), array.dtype))

    def samples(self) -> list[Any]:
        """The samples added, out of their rows again (copies): to be collated as a list."""
        def back(row: int) -> Callable[[tuple[Any, ...], Any], Any]:
            return lambda _, stacked: stacked.batch[self._first_row + row].copy()

        return [_arrays_by_place(rest, back(row), kind=Stacked)
                for row, rest in enumerate(self._rests)]

    def layout(self) -> Layout:
        """Where each array's rows lie in the block, every row of the chunk's."""
        places = {path: self._allocate.place(stacked.batch)
                  for path, stacked in self._batches.items()}
        return tuple((path, place) for path, place in places.items() if place is not None)

    def batch(self) -> Any:
        """The batch of the samples added: their rows, and the rest collated around them."""
        for stacked in self._batches.values():
            stacked.batch = stacked.batch[self._first_row : self._first_row + self.count]
        if self._part:
            return default_collate(self._rests)
        try:
            return default_collate(self._rests, self._allocate)
        except transport.NoRoom:  # numbers promoted past the room kept: out of the block
            return default_collate(self._rests)


class Widened(Exception):
    """A sample's array would widen the dtype of the batch's rows (as collate promotes)."""


def _arrays_by_place(value: Any, replace: Callable[[tuple[Any, ...], Any], Any],
                     path: tuple[Any, ...] = (), kind: type = np.ndarray) -> Any:
    """`value` with each shareable array (or each `kind`) replaced by `replace(path, it)`,
    where `path` is its place (keys and positions) in the containers `default_collate` walks
    into."""
    if isinstance(value, kind):
        shareable = not isinstance(value, np.ndarray) or not value.dtype.hasobject
        return replace(path, value) if shareable else value
    if isinstance(value, Mapping):
        mapped = {k: _arrays_by_place(v, replace, (*path, k), kind) for k, v in value.items()}
        return mapped if type(value) is dict else type(value)(mapped)  # type: ignore[call-arg]
    if isinstance(value, (tuple, list)) and not isinstance(value, (str, bytes)):
        parts = [_arrays_by_place(v, replace, (*path, n), kind) for n, v in enumerate(value)]
        if hasattr(value, "_fields"):
            return type(value)(*parts)
        return type(value)(parts)
    return value


def _count_numbers(value: Any) -> int:
    """Numbers in a sample (each becomes an array of the batch: room is kept for them)."""
    if scalar_dtype(value) is not None:
        return 1
    if isinstance(value, Mapping):
        return sum(map(_count_numbers, value.values()))
    if isinstance(value, (tuple, list)):
        return sum(map(_count_numbers, value))
    return 0


def join_results(results: list[ChunkResult], sizes: list[int],
                 allocate: transport.BlockAllocator | None = None) -> ChunkResult:
    """The results of consecutive parts of one chunk (of `sizes` samples each, collated by
    `default_collate`) as the one result of the whole chunk: its first failure, its skipped
    samples at their places in the chunk, one batch (its arrays from `allocate`, if given)."""
    return _joined_by(results, sizes, lambda batches: _joined(batches, allocate))


def join_rows(results: list[ChunkResult], sizes: list[int],
              memory: np.ndarray[Any, Any]) -> ChunkResult:
    """`join_results` for parts whose arrays' rows lie in one block (`memory`, mapped here)
    at the places the first part gave (`Rows`): rows of a part that skipped samples move up so
    that the batch's rows follow each other, rows a part kept in its heap are copied in, and
    numbers and text are joined here. The arrays stay places in the block."""
    return _joined_by(results, sizes, lambda batches: _rows_joined(batches, memory))


def _joined_by(results: list[ChunkResult], sizes: list[int],
               join: Callable[[list[Any]], Any]) -> ChunkResult:
    joined = ChunkResult([], [], process=results[0].process)
    offset = 0
    for result, size in zip(results, sizes, strict=True):
        joined.skipped += [(offset + position, reason) for position, reason in result.skipped]
        if result.failure is not None and joined.failure is None:
            joined.failure = result.failure
        joined.read_errors.update(result.read_errors)
        offset += size
    batches = [result.items[0] for result in results if result.items]
    if joined.failure is None and batches:
        try:
            joined.items = [join(batches)]
        except Exception as e:
            joined.failure = failure(None, e)
    return joined


def _rows_joined(batches: list[Any], memory: np.ndarray[Any, Any]) -> Any:
    first = batches[0]
    if isinstance(first, transport.SharedArray):
        rows = [transport.view_at(memory, part) if isinstance(part, transport.SharedArray)
                else np.asarray(part) for part in batches]
        check_same_shapes([part[0] for part in rows if len(part)])
        if np.result_type(*rows) != np.dtype(first.dtype):  # a part widened: as collate does
            return np.concatenate(rows)
        row_bytes = rows[0][0].nbytes if len(rows[0]) else 0
        at = 0
        for part, values in zip(batches, rows, strict=True):
            place = transport.SharedArray(first.offset + at * row_bytes, values.shape, first.dtype)
            if not (isinstance(part, transport.SharedArray) and part == place):
                np.copyto(transport.view_at(memory, place), values, casting="same_kind")
            at += len(values)
        return transport.SharedArray(first.offset, (at, *first.shape[1:]), first.dtype)
    if isinstance(first, np.ndarray) or (
            isinstance(first, list) and all(isinstance(v, (str, bytes)) for v in first)):
        return concatenate(batches)
    joined = by_field(batches, lambda part: _rows_joined(list(part), memory))
    if joined is NotImplemented:
        raise TypeError(f"cannot join batches of {type(first).__name__}")
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
    kind: str
    """The error's type (`type_name`): raised with it in the consumer's process."""
    error: Exception | None = None
    """A read's failure (a file or record read here): it travels as it is."""


def failure(index: int | None, error: Exception) -> tuple[int | None, str, str, str]:
    """A chunk's failure as it travels: the sample's index (None: collate), the reason, the
    traceback, the error's type."""
    return index, one_line(error), traceback.format_exc(), type_name(error)


class ReadFailed(Exception):
    """A sample's read in this process (`DecodeSpec.load_reads`) raised `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _Exhausted:
    """What `_one` gives once an IterableDataset's iterator ran out: the chunk ends there."""


EXHAUSTED = _Exhausted()
Outcome = tuple[Any, float, float] | _Failure | _Exhausted
"""A sample with when its decode started and ended, why it failed, or the end of the data."""


def _one(spec: DecodeSpec, epoch: int, index: int, raw: Any) -> Outcome:
    started = now()
    try:
        sample = spec.sample(epoch, index, raw)
    except Exhausted:
        return EXHAUSTED
    except ReadFailed as e:
        return _Failure(one_line(e.error), traceback.format_exc(), type_name(e.error), e.error)
    except FetchError as e:
        return _Failure(str(e), traceback.format_exc(), type_name(e), e)
    except Exception as e:
        return _Failure(one_line(e), traceback.format_exc(), type_name(e))
    return sample, started, now()


_threads: ThreadPoolExecutor | None = None
"""A decode process's threads for `spec.threads` (one spec per process: made once)."""
_cheap: bool | None = None
"""Whether this process's samples take so little time that threads would only add switching:
decided on the first ones (CHEAP_SECONDS each, on average)."""
CHEAP_SECONDS = 0.001
TRIAL = 4


def _outcomes(spec: DecodeSpec, chunk: Chunk) -> Iterator[Outcome]:
    """Each sample of the chunk, or why it failed, as it is made (so that a caller keeping
    one at a time holds one); on `spec.threads` threads when more than one and samples are
    not cheap, so that blocking reads in `load` overlap (results keep the chunk's order)."""
    global _cheap
    jobs = list(zip(chunk.indices, chunk.raws, strict=True))

    def run(job: tuple[int, Any]) -> Outcome:
        return _one(spec, chunk.epoch, *job)

    if spec.threads <= 1 or len(jobs) <= 1 or _cheap:
        return map(run, jobs)
    if _worker_info is None:  # inline (num_workers=0): no thread outlives the chunk
        with ThreadPoolExecutor(spec.threads, thread_name_prefix="aioloader-load") as inline:
            return iter(list(inline.map(run, jobs)))
    done: Iterable[Outcome] = ()
    if _cheap is None:
        started = now()
        done = [run(job) for job in jobs[:TRIAL]]
        _cheap = (now() - started) / len(done) < CHEAP_SECONDS
        jobs = jobs[len(done):]
        if _cheap:
            return itertools.chain(done, map(run, jobs))

    global _threads
    if _threads is None:
        _threads = ThreadPoolExecutor(spec.threads, thread_name_prefix="aioloader-load")
    return itertools.chain(done, _threads.map(run, jobs))


def respond(spec: DecodeSpec, chunk: Chunk) -> ChunkResult:
    """Run a chunk in a decode process and put large results into the lent block."""
    slot = chunk.slot
    allocate = transport.BlockAllocator(slot) if slot is not None else None
    result = run_chunk(spec, chunk, allocate)
    if allocate is not None and allocate.used and result.failure is None:
        result.items = allocate.places(result.items)  # collated straight into the block
        result.needed, result.shared = allocate.used, True
        return result
    if allocate is not None:
        allocate.discard()
    if result.items and result.failure is None:
        result.needed = transport.shared_bytes(result.items)
        if slot is not None and result.needed >= transport.SMALL_RESULT and not chunk.rows:
            try:
                placed = transport.write(result.items, slot, result.needed)
            except transport.NoSpace:
                result.no_space = True
            else:
                if placed is not None:
                    result.items, result.shared = placed, True
    return result
