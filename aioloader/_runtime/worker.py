"""The decode process: what it runs (the decode spec on chunks), how it starts, and
`get_worker_info()` for code running in it.

A chunk is the unit sent to a process: the raw items of one batch (or of a few unbatched
samples). Decoding and collating a whole batch in one task keeps the traffic to one message each
way per batch, whatever the batch size.
"""

from __future__ import annotations

import inspect
import os
import pickle
import pickletools
import random
import re
import signal
import socket
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import numpy as np

from .._cache import CachedSample, SharedCache
from .._collate import default_collate
from .._sampling import sample_rng
from .._stats import now
from . import transport
from .channel import Channel


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
                self.cache.put(index, value)
        if self.augment is None:
            return value
        if self.augment_wants_rng:
            return self.augment(value, sample_rng(self.seed, epoch, index))
        return self.augment(value)


def own_elements(value: Any) -> Any:
    """`value` with each torch tensor that views a larger storage replaced by a copy of its
    own elements. Pickling a tensor sends its whole storage, so a 1 KiB slice of a 64 MiB
    tensor would cross as 64 MiB (DataLoader's workers share storages instead)."""
    torch = sys.modules.get("torch")
    if torch is None or not transport.holds(value, torch.Tensor):
        return value

    def own(tensor: Any) -> Any:
        if tensor.layout == torch.strided and tensor.untyped_storage().nbytes() > tensor.nbytes:
            return tensor.clone()
        return tensor

    return transport.map_arrays(value, own, torch.Tensor)


@dataclass
class Chunk:
    epoch: int
    indices: list[int]
    raws: list[Any]
    slot: transport.Slot | None = None
    """A shared-memory block to hand the result back in, when the main process has one."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a decode process: tensor views travel as their own elements."""
        return {**vars(self), "raws": own_elements(self.raws)}


@dataclass
class ChunkResult:
    items: list[Any]
    """One collated batch, nothing if every sample was skipped, or the samples when unbatched."""
    skipped: list[tuple[int, str]]
    """(position in the chunk, one-line reason) of samples whose decode raised (skip mode)."""
    failure: tuple[int | None, str, str] | None = None
    """(index, one-line reason, traceback) of the first failure in raise mode; index None:
    collate failed."""
    timings: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of each decoded sample, on the clock of `stats.now`."""
    process: str = "inline"
    """Which decode process ran the chunk, for the timeline."""
    shared: bool = False
    """The items' arrays are in the chunk's slot (SharedArray places in `items`)."""
    needed: int = 0
    """Bytes the items' arrays need in shared memory."""
    no_space: bool = False
    """/dev/shm could not hold the block: the items came pickled instead."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for the main process: tensor views travel as their own elements."""
        return {**vars(self), "items": own_elements(self.items)}


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
        result.timings.append((started, ended))
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


# -- messages -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Init:
    """The first message a decode process gets: who it is, the spec, and the main process's
    import path, arguments, working directory, environment and warning filters, so code
    behaves as it would there."""

    code: bytes
    """The spec and worker_init, pickled together: functions of `__main__` share one copy of
    its globals, so what worker_init sets there, decode sees."""
    worker_id: int
    num_workers: int
    seed: int
    sys_path: list[str]
    argv: list[str]
    cwd: str
    environ: dict[str, str]
    warning_filters: list[Any]


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class InitFailed:
    reason: str
    traceback: str


@dataclass(frozen=True)
class Task:
    id: int
    chunk: Chunk


@dataclass(frozen=True)
class Done:
    id: int
    result: ChunkResult


@dataclass(frozen=True)
class Imported:
    """Installed packages this process imported beyond the zygote's, after its first chunk."""

    packages: list[str]


STOP = "stop"


def installed_packages(modules: set[str]) -> list[str]:
    """The top-level packages among `modules` that come from the Python installation
    (standard library, site-packages), not from the user's own folders."""
    roots = _installation_roots()
    return sorted({name.partition(".")[0] for name in modules
                   if _installed(name.partition(".")[0], roots)})


def packages_behind(pickles: list[bytes]) -> list[str]:
    """The installed packages that unpickling `pickles` imports: those it names, and those the
    user's own modules it names import (followed through their globals, as importing them
    runs their imports). The zygote imports them once, before the first decode processes
    fork, rather than each process on its own."""
    roots = _installation_roots()
    todo = [arg for pickled in pickles for _, arg, _ in pickletools.genops(pickled)
            if isinstance(arg, str) and arg in sys.modules and not arg.startswith("__")]
    seen: set[str] = set()
    found: set[str] = set()
    while todo:
        name = todo.pop()
        top = name.partition(".")[0]
        if name in seen or top == "aioloader":
            continue
        seen.add(name)
        if _installed(top, roots):
            found.add(top)
            continue
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            named = value.__name__ if isinstance(value, ModuleType) else getattr(
                value, "__module__", None)
            if isinstance(named, str) and named in sys.modules and not named.startswith("__"):
                todo.append(named)
    return sorted(found)


def _installation_roots() -> set[str]:
    return {os.path.realpath(p) for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))}


def _installed(top: str, roots: set[str]) -> bool:
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None)
    if top.startswith("__") or where is None:
        return False
    where = os.path.realpath(where)
    return any(where.startswith(root + os.sep) for root in roots)


def _start(init: Init) -> DecodeSpec:
    global _worker_info
    sys.path[:] = init.sys_path
    sys.argv[:] = init.argv
    os.environ.clear()
    os.environ.update(init.environ)
    os.chdir(init.cwd)
    warnings.resetwarnings()
    cast(list[Any], warnings.filters).extend(init.warning_filters)
    seed = init.seed + init.worker_id
    random.seed(seed)
    np.random.seed(seed % 2**32)
    _worker_info = WorkerInfo(init.worker_id, init.num_workers, seed)
    spec: DecodeSpec
    spec, worker_init = pickle.loads(init.code)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    if worker_init is not None:
        worker_init(init.worker_id)
    return spec


def serve(descriptor: int) -> int:
    """A decode process's life: start as told, then decode chunks until told to stop or until
    the main process is gone (end of the channel)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    channel = Channel(socket.socket(fileno=descriptor))
    preloaded = set(sys.modules)
    reported = False
    try:
        init = channel.receive()
        try:
            spec = _start(init)
        except BaseException as e:
            channel.send(InitFailed(one_line(e), traceback.format_exc()))
            return 1
        channel.send(Ready(os.getpid()))
        while (message := channel.receive()) != STOP:
            channel.send(Done(message.id, respond(spec, message.chunk)))
            if not reported:
                reported = True
                channel.send(Imported(installed_packages(set(sys.modules) - preloaded)))
    except (EOFError, OSError):
        pass
    finally:
        channel.close()
    return 0
