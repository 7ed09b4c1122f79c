"""What the main process and a decode process send each other over their channel.

A chunk is the unit sent to a process: the raw items of one batch (or of a few unbatched
samples). Decoding and collating a whole batch in one task keeps the traffic to one message each
way per batch, whatever the batch size.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

from . import transport


def own_elements(value: Any) -> Any:
    """`value` with each torch tensor that views a larger storage replaced by a copy of its
    own elements. Pickling a tensor sends its whole storage, so a 1 KiB slice of a 64 MiB
    tensor would cross as 64 MiB (DataLoader's workers share storages instead)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value

    def own(tensor: Any) -> Any:
        if tensor.layout == torch.strided and tensor.untyped_storage().nbytes() > tensor.nbytes:
            return tensor.clone()
        return tensor

    return transport.map_arrays(value, own, torch.Tensor)


Layout = tuple[tuple[tuple[Any, ...], transport.SharedArray], ...]
"""Each array of a batch by its place in a sample (keys and positions), and where its rows lie
in a block."""


@dataclass
class Chunk:
    epoch: int
    indices: list[int]
    raws: list[Any]
    slot: transport.Slot | None = None
    """A shared-memory block to hand the result back in, when the main process has one."""
    step: int = 0
    """The pass's step it starts: a decode pool serving several passes runs the earliest first."""
    rows: int = 0
    """A part of a pass's first chunk: rows its block keeps, one for every sample of the
    chunk (0: not a part; the block keeps the chunk's own)."""
    first_row: int = 0
    """A part: the row of the block its first sample goes to."""
    layout: Layout | None = None
    """A part after the first: where the batch's arrays lie in the lent block (the first
    part's `ChunkResult.layout`), by their place in a sample."""
    worker: int | None = None
    """An IterableDataset's chunk: the decode process (its worker id) whose iterator it
    continues; None: any process."""
    on_send: Callable[[Chunk], None] | None = field(default=None, repr=False, compare=False)
    """Called as the chunk goes to a decode process, and not sent with it: the pass lends the
    chunk its block then, not while the chunk waits for a process, so that blocks freed
    meanwhile are used again rather than new ones made (each new block's pages are zeroed)."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for a decode process: tensor views travel as their own elements."""
        state = {**vars(self), "raws": own_elements(self.raws)}
        state.pop("on_send", None)
        return state


@dataclass
class ChunkResult:
    items: list[Any]
    """One collated batch, nothing if every sample was skipped, or the samples when unbatched."""
    skipped: list[tuple[int, str]]
    """(position in the chunk, one-line reason) of samples whose decode raised (skip mode)."""
    failure: tuple[int | None, str, str, str] | None = None
    """(index, one-line reason, traceback, the error's type name) of the first failure in
    raise mode; index None: collate failed."""
    durations: list[float] = field(default_factory=list)
    """Seconds each decoded sample took."""
    span: tuple[float, float] | None = None
    """(start, end) of the chunk's decoding, on the clock of `stats.now`: one box on the
    timeline per chunk, not per sample, keeps the bookkeeping off the per-sample path."""
    process: str = "inline"
    """Which decode process ran the chunk, for the timeline."""
    shared: bool = False
    """The items' arrays are in the chunk's slot (SharedArray places in `items`)."""
    needed: int = 0
    """Bytes the items' arrays need in shared memory."""
    no_space: bool = False
    """Shared memory could not hold the block: the items came pickled instead."""
    layout: Layout | None = None
    """The first part of a pass's first chunk: where each array of the batch lies in the
    block, with a row for every sample of the chunk."""
    exhausted: bool = False
    """An IterableDataset's chunk: the worker's iterator ran out while filling it."""
    copy_state: Any = None
    """An IterableDataset's chunk: where the worker's copy stood after it
    (`FromTorchIterable.snapshot`)."""
    received: int = 0
    """Bytes of the chunk's message, as its decode process received them through its channel
    (0: decoded where it was made, or by a backend that does not say)."""
    read_errors: dict[int, Exception] = field(default_factory=dict)
    """By sample index: a read in the decode process that failed (a `FetchError` of a file
    read there), raised or skipped as a failed read, not as a failed decode."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for the main process: tensor views travel as their own elements."""
        return {**vars(self), "items": own_elements(self.items)}


class _Named(NamedTuple):
    """A warning category by name, found again where its module is imported."""

    module: str
    qualname: str


@dataclass(frozen=True)
class Environment:
    """The main process's import path, arguments, working directory, environment variables and
    warning filters, taken on by the processes it starts, so code behaves as it would there."""

    sys_path: list[str]
    argv: list[str]
    cwd: str
    environ: dict[str, str]
    warning_filters: list[tuple[str, Any, Any, Any, int]]
    """Each filter with its category by name, or by value when no other process can find it
    by name (a class of `__main__` or of a function): a filter on a class of aiohttp (which
    `aiohttp.web` adds) or of torch, unpickled, would import that package in every process
    (0.15 s for aiohttp in each decode process, before its first chunk)."""

    @classmethod
    def here(cls) -> Environment:
        filters = [(action, message, _by_name(category), module, line)
                   for action, message, category, module, line in cast(
                       list[Any], warnings.filters)]
        return cls(list(sys.path), list(sys.argv), os.getcwd(), dict(os.environ), filters)

    def take_on(self) -> None:
        sys.path[:] = self.sys_path
        sys.argv[:] = self.argv
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        self.filter_warnings()

    def filter_warnings(self) -> None:
        """The filters whose category this process has imported (a warning of a class not
        imported here cannot be raised here); called again once decode code is imported. A
        module imported later, by decode itself, does not bring its filters back."""
        warnings.resetwarnings()
        filters = cast(list[Any], warnings.filters)
        for action, message, category, module, line in self.warning_filters:
            found = _category(category)
            if found is not None:
                filters.append((action, message, found, module, line))


def _by_name(category: Any) -> Any:
    if isinstance(category, tuple):  # warnings matches a tuple of classes too
        return tuple(_by_name(member) for member in category)
    if (isinstance(category, type) and category.__module__ != "__main__"
            and "<locals>" not in category.__qualname__):
        return _Named(category.__module__, category.__qualname__)
    return category


def _category(named: Any) -> Any:
    """The category `named` stands for here; None if its module is not imported here."""
    if isinstance(named, _Named):
        found: Any = sys.modules.get(named.module)
        for part in named.qualname.split("."):
            found = getattr(found, part, None)
        return found if isinstance(found, type) and issubclass(found, Warning) else None
    if isinstance(named, tuple):
        members = tuple(m for m in map(_category, named) if m is not None)
        return members or None
    return named


@dataclass(frozen=True)
class Init:
    """The first message a decode process gets: who it is, the spec, and where it runs."""

    code: bytes
    """The spec and worker_init, pickled together: functions of `__main__` share one copy of
    its globals, so what worker_init sets there, decode sees."""
    worker_id: int
    num_workers: int
    seed: int
    environment: Environment


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class InitFailed:
    reason: str
    traceback: str
    kind: str = ""
    """The error's type (`_errors.type_name`)."""


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
