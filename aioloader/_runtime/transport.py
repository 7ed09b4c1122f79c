"""Batches handed back from decode processes through shared memory instead of pickles.

The main process owns a bounded pool of blocks in /dev/shm. Each decode task is lent a block;
the process writes the batch's arrays into it and sends back only their places (offset, shape,
dtype). The main process maps them as numpy arrays over the block, without a copy. A block goes
back to the pool only when no array viewing it is alive (a finalizer on the array the views
hang from), so batches a consumer keeps never change. Blocks are registered with Python's
resource tracker, which removes them should this process die, and removed by `close()`.
Results under `SMALL_RESULT` bytes of arrays keep the pickle path; Linux only.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import numpy.typing as npt

SHM_DIR = "/dev/shm"
SMALL_RESULT = 64 * 1024
ALIGN = 64
_ATTACHED_IN_WORKER = 32


def available() -> bool:
    return sys.platform == "linux" and os.path.isdir(SHM_DIR)


@dataclass(frozen=True)
class Slot:
    """A block lent to one decode task."""

    name: str
    size: int


@dataclass(frozen=True)
class SharedArray:
    """Where an array of a result lies in its block."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


def map_arrays(value: Any, function: Callable[[Any], Any], kind: type = np.ndarray) -> Any:
    """`value` with every `kind` inside dicts, lists and tuples replaced by `function(it)`."""
    if isinstance(value, kind):
        return function(value)
    if isinstance(value, Mapping):
        return type(value)(  # type: ignore[call-arg]
            {k: map_arrays(v, function, kind) for k, v in value.items()}
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_arrays(v, function, kind) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_arrays(v, function, kind) for v in value)
    return value


def _shareable(array: npt.NDArray[Any]) -> bool:
    return not array.dtype.hasobject


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def shared_bytes(value: Any) -> int:
    """Bytes the shareable arrays of `value` need in a block."""
    total = 0

    def count(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        nonlocal total
        if _shareable(array):
            total += _aligned(array.nbytes)
        return array

    map_arrays(value, count)
    return total


# -- decode process side ------------------------------------------------------------------------

_attached: OrderedDict[str, mmap.mmap] = OrderedDict()


def _attach(name: str) -> mmap.mmap:
    block = _attached.pop(name, None)
    if block is None:
        with open(SHM_DIR + name, "r+b") as file:
            block = mmap.mmap(file.fileno(), 0)
        while len(_attached) >= _ATTACHED_IN_WORKER:
            _attached.popitem(last=False)[1].close()
    _attached[name] = block
    return block


def fits(slot: Slot, needed: int) -> bool:
    """Can the slot take `needed` bytes: an existing block large enough, or a fresh name."""
    return needed <= slot.size or slot.size == 0


def write(value: Any, slot: Slot, needed: int) -> Any:
    """Copy the shareable arrays of `value` into the slot's block (made now, `needed` bytes
    large, when the slot is a fresh name); their places instead of them."""
    if slot.size == 0:
        descriptor = os.open(SHM_DIR + slot.name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(descriptor, needed)
        finally:
            os.close(descriptor)
    memory = np.frombuffer(_attach(slot.name), np.uint8)
    offset = 0

    def place(array: npt.NDArray[Any]) -> Any:
        nonlocal offset
        if not _shareable(array):
            return array
        target = memory[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(target, array)
        here = SharedArray(offset, array.shape, array.dtype.str)
        offset += _aligned(array.nbytes)
        return here

    return map_arrays(value, place)


class NoRoom(Exception):
    """A batch outgrew the block it was being collated into."""


class BlockAllocator:
    """Hands out arrays inside a lent block, front to back, so collate writes the batch
    straight into shared memory (one copy less than collating, then copying)."""

    def __init__(self, slot: Slot) -> None:
        self._memory = np.frombuffer(_attach(slot.name), np.uint8)
        self.used = 0
        self._places: dict[int, tuple[npt.NDArray[Any], SharedArray]] = {}

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        size = int(np.prod(shape)) * dtype.itemsize
        if self.used + size > len(self._memory):
            raise NoRoom
        array = self._memory[self.used : self.used + size].view(dtype).reshape(shape)
        self._places[id(array)] = (array, SharedArray(self.used, shape, dtype.str))
        self.used = _aligned(self.used + size)
        return array

    def places(self, value: Any) -> Any:
        """`value` with the arrays handed out here replaced by their places."""
        return map_arrays(value, lambda a: self._places[id(a)][1] if id(a) in self._places else a)


# -- main process side --------------------------------------------------------------------------


class BlockPool:
    """The main process's blocks: lent to tasks, mapped into batches, reused when free.

    A task is lent a free block, or, while there are fewer than `max_blocks`, a fresh name the
    decode process creates the block under, at the size its batch needs. A block too small
    for a later batch is retired. Every name is registered with the resource tracker before
    a process may create it.
    """

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._maps: dict[str, mmap.mmap] = {}
        self._sizes: dict[str, int] = {}
        """Every name lent or free; size 0 while a decode process may still be creating it."""
        self._free: list[str] = []
        self._orphans: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._names = (f"/aioloader-{os.getpid()}-{secrets.token_hex(4)}-{n}"
                       for n in itertools.count())

    def lease(self) -> Slot | None:
        """A block for one task, or None when all are lent out (then the result is pickled)."""
        with self._lock:
            if self._closed:
                return None
            if self._free:
                name = self._free.pop()
                return Slot(name, self._sizes[name])
            if len(self._sizes) >= self.max_blocks:
                return None
            name = next(self._names)
            resource_tracker.register(name, "shared_memory")
            self._sizes[name] = 0
            return Slot(name, 0)

    def release(self, name: str) -> None:
        """The task is over or its views are gone: the block is free again (a fresh name that
        was not used, or a block too small for the last batch, is removed)."""
        with self._lock:
            if name not in self._sizes:
                return
            if name not in self._maps:
                # a fresh name whose task ended early: its process may still be creating the
                # block, so it stays registered until the processes are gone (sweep)
                self._orphans.add(name)
            elif self._closed:
                self._remove(name)
            elif name not in self._free:
                self._free.append(name)

    def sweep(self) -> None:
        """Remove fresh names lent to tasks that ended early; call once no decode process
        that could still create them is running."""
        with self._lock:
            for name in self._orphans:
                self._remove(name)
            self._orphans.clear()

    def retire(self, name: str) -> None:
        with self._lock:
            self._remove(name)

    def adopt(self, value: Any, slot: Slot) -> Any:
        """`value` with each SharedArray replaced by a view of the block; the block returns
        to the pool once every view is gone."""
        with self._lock:
            block = self._maps.get(slot.name)
            if block is None:  # made by the decode process just now
                with open(SHM_DIR + slot.name, "r+b") as file:
                    block = self._maps[slot.name] = mmap.mmap(file.fileno(), 0)
                self._sizes[slot.name] = len(block)
        owner = np.frombuffer(block, np.uint8)
        weakref.finalize(owner, self.release, slot.name)

        def view(place: SharedArray) -> npt.NDArray[Any]:
            dtype = np.dtype(place.dtype)
            size = int(np.prod(place.shape)) * dtype.itemsize
            return owner[place.offset : place.offset + size].view(dtype).reshape(place.shape)

        return map_arrays(value, view, SharedArray)

    def _remove(self, name: str) -> None:
        """Unlink a block; its memory goes when the last view of it does."""
        self._maps.pop(name, None)
        self._sizes.pop(name, None)
        if name in self._free:
            self._free.remove(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR + name)
        resource_tracker.unregister(name, "shared_memory")

    @property
    def segments(self) -> int:
        return len(self._sizes)

    def close(self) -> None:
        """Unlink every block now; batches still held keep their memory until dropped."""
        with self._lock:
            self._closed = True
            for name in list(self._sizes):
                self._remove(name)
            self._orphans.clear()
