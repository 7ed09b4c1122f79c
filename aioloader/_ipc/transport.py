"""Batches handed back from decode processes through shared memory instead of pickles.

The main process owns a bounded pool of blocks (memory by descriptor: `shm`). Each decode task
is lent one (`Slot`): a block of known size, or a fresh, empty one the decode process fills at
the size its batch needs, with the space reserved so that memory that runs out gives a pickled
batch and a warning instead of SIGBUS. The process writes the batch's arrays into the block
and sends back only their places; the main process maps them as numpy arrays over the block,
without a copy. A block returns to the pool only when no array viewing it is alive, so batches
a consumer keeps never change. Results under `SMALL_RESULT` bytes of arrays keep the pickle
path.
"""

from __future__ import annotations

import math
import mmap
import os
import resource
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from .. import _reaper as reaper
from .._closing import ProcessBound
from . import shm
from .shm import NoSpace

__all__ = ["NoSpace"]

SMALL_RESULT = 64 * 1024
ALIGN = 64


@dataclass(frozen=True)
class Slot:
    """A block lent to one decode task (`name`: its token); size 0: a fresh block the process
    gives its size."""

    name: str
    size: int


@dataclass(frozen=True)
class SharedArray:
    """Where an array of a result lies in its block."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


def map_arrays(value: Any, function: Callable[[Any], Any], kind: type = np.ndarray) -> Any:
    """`value` with every `kind` inside dicts (and other mappings), lists, tuples and
    namedtuples replaced by `function(it)`: the one walk of nested samples and batches. Only
    the containers of what was replaced are rebuilt, so a walk that replaces nothing returns
    `value` itself and costs no copies."""
    exact = type(value)
    if exact in _SCALARS:
        return value
    if isinstance(value, kind):
        return function(value)
    if exact is dict or isinstance(value, Mapping):
        changes = _changes(value.items(), function, kind)
        if not changes:
            return value
        mapped = {**value, **changes}
        return mapped if exact is dict else exact(mapped)
    if exact is list or exact is tuple or isinstance(value, (list, tuple)):
        changes = _changes(enumerate(value), function, kind)
        if not changes:
            return value
        parts = [changes.get(position, part) for position, part in enumerate(value)]
        if hasattr(value, "_fields"):  # namedtuple
            return exact(*parts)
        return parts if exact is list else exact(parts)
    return value


def _changes(
    parts: Iterable[tuple[Any, Any]], function: Callable[[Any], Any], kind: type
) -> dict[Any, Any]:
    """The parts (by key or position) in which `map_arrays` replaced something."""
    changes = {}
    for key, part in parts:
        if type(part) not in _SCALARS:
            mapped = map_arrays(part, function, kind)
            if mapped is not part:
                changes[key] = mapped
    return changes


_SCALARS = frozenset({bytes, str, int, float, bool, type(None)})
"""Types that hold nothing to map, skipped before the slower `isinstance` checks."""


def _shareable(array: npt.NDArray[Any]) -> bool:
    return not array.dtype.hasobject


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def shared_bytes(value: Any) -> int:
    """Bytes the shareable arrays of `value` need in a block."""
    total = 0

    def count(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
        nonlocal total
        if _shareable(array):
            total += aligned(array.nbytes)
        return array

    map_arrays(value, count)
    return total


# -- decode process side ------------------------------------------------------------------------
# A decode process maps a block only while it works on the chunk the block was lent to: the
# mapping goes with the last array viewing it, when `decode.respond` returns. A mapping kept
# longer would hold the block's memory after the main process lets go of it, out of sight of the
# pool's byte count and of the main process's RSS (a cache of 32 blocks held 880 MiB with a
# memory_limit of 64 MiB). The pages are mapped in one call (`populate`), so mapping anew per
# chunk costs little next to writing the batch.


def write(value: Any, slot: Slot, needed: int) -> Any | None:
    """The shareable arrays of `value` copied into the slot's block (given `needed` bytes now,
    when it is fresh), replaced by their places; None if the block is too small. NoSpace when
    shared memory cannot hold a fresh block."""
    block = _block(slot, needed)
    if block is None:
        return None
    memory = np.frombuffer(block, np.uint8)
    offset = 0

    def place(array: npt.NDArray[Any]) -> Any:
        nonlocal offset
        if not _shareable(array):
            return array
        target = memory[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(target, array)
        here = SharedArray(offset, array.shape, array.dtype.str)
        offset += aligned(array.nbytes)
        return here

    return map_arrays(value, place)


def allocator(slot: Slot, needed: int) -> BlockAllocator | None:
    """An allocator over the slot's block (given `needed` bytes now, when it is fresh); None if
    the block is too small. NoSpace when shared memory cannot hold it."""
    block = _block(slot, needed)
    return None if block is None else BlockAllocator(slot, block)


def _block(slot: Slot, needed: int) -> mmap.mmap | None:
    """The slot's block mapped: given `needed` bytes if it is fresh, else if it can hold them
    (None if not)."""
    if slot.size == 0:
        return shm.fill(slot.name, needed, populate=True)
    if needed <= slot.size:
        return shm.attach_block(slot.name, populate=True)
    return None


class NoRoom(Exception):
    """A batch outgrew the block it was being collated into."""


class BlockAllocator:
    """Hands out arrays inside a lent block, front to back, so collate writes the batch
    straight into shared memory (one copy less than collating, then copying). The block is
    mapped at the first array asked for (a custom collate never maps it here), or when `open`
    learns the batch's size: a fresh block is given that size then."""

    def __init__(self, slot: Slot, block: mmap.mmap | None = None) -> None:
        self._slot = slot
        self._memory: npt.NDArray[np.uint8] | None = (
            None if block is None else np.frombuffer(block, np.uint8))
        self._created = False
        self.used = 0

    def open(self, needed: int) -> None:
        """Map the block for a batch of `needed` bytes, sizing it if it is fresh; NoRoom if the
        lent block is smaller, NoSpace if shared memory cannot hold a fresh one."""
        if self._memory is not None:
            return
        block = _block(self._slot, needed)
        if block is None:
            raise NoRoom
        self._memory, self._created = np.frombuffer(block, np.uint8), self._slot.size == 0

    def open_lent(self) -> None:
        if self._memory is None:
            if self._slot.size == 0:
                raise NoRoom  # a fresh block: nothing to map until the size is known
            self.open(self._slot.size)

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        self.open_lent()
        assert self._memory is not None
        size = math.prod(shape) * dtype.itemsize
        if self.used + size > len(self._memory):
            raise NoRoom
        array = self._memory[self.used : self.used + size].view(dtype).reshape(shape)
        self.used = aligned(self.used + size)
        return array

    def view(self, place: SharedArray) -> npt.NDArray[Any]:
        """The array at `place` in the lent block (a part writes its rows there)."""
        self.open_lent()
        assert self._memory is not None
        array = view_at(self._memory, place)
        self.used = max(self.used, place.offset + array.nbytes)
        return array

    def place(self, array: npt.NDArray[Any]) -> SharedArray | None:
        """Where `array` lies in the block; None if it is not in it."""
        if self._memory is None or not array.flags.c_contiguous:
            return None
        start = self._memory.ctypes.data
        address = array.ctypes.data
        if start <= address < start + len(self._memory):
            return SharedArray(address - start, array.shape, array.dtype.str)
        return None

    def places(self, value: Any) -> Any:
        """`value` with the arrays that lie in the block (handed out here, or rows of those)
        replaced by their places."""
        return map_arrays(value, lambda array: self.place(array) or array)

    def discard(self) -> None:
        """The batch went elsewhere (pickled, or it failed): a block sized here is emptied, so
        it stays fresh for the pool and holds no memory."""
        self.used = 0
        if self._created:
            self._memory, self._created = None, False
            shm.empty(self._slot.name)


@dataclass
class Exported:
    """One item of a result whose arrays lie in a shared block (SharedArray places in
    `value`), on its way to the process that maps it."""

    name: str
    value: Any


def view_at(memory: npt.NDArray[np.uint8], place: SharedArray) -> npt.NDArray[Any]:
    """The array at `place` in a block's memory."""
    dtype = np.dtype(place.dtype)
    size = math.prod(place.shape) * dtype.itemsize
    return memory[place.offset : place.offset + size].view(dtype).reshape(place.shape)


def views(block: mmap.mmap, value: Any, on_free: Callable[[], Any]) -> Any:
    """`value` with each SharedArray replaced by a view of `block`; `on_free` runs once no
    view is left."""
    owner = np.frombuffer(block, np.uint8)
    weakref.finalize(owner, on_free)
    return map_arrays(value, lambda place: view_at(owner, place), SharedArray)


# -- main process side --------------------------------------------------------------------------


class BlockPool(ProcessBound):
    """The main process's blocks: lent to tasks, mapped into batches, reused when free.

    A task is lent a free block, or, while there are fewer than `max_blocks`, a fresh one the
    decode process gives its size: how many bytes that comes to is the memory budget's to
    bound (`budget.py`), which admits a chunk only when its batch fits. Past `max_blocks`
    (batches a consumer keeps hold of), a fresh block is lent all the same, removed when
    released: a batch is pickled only when shared memory is short, or when the blocks would
    take a quarter of the descriptors this process may open (each costs two: the pool's, and
    its mapping's). A block too small for a later batch, or idle past the room the budget
    leaves, is removed rather than kept.
    The pool holds each block by its descriptor; removing one closes it, and its memory goes
    with the last mapping (a process still writing it, a view still held). When this process
    ends, however it ends, so do its blocks.
    In a child forked from this process the blocks are the parent's: it leases none, and
    releasing or closing does nothing there (without the lock, which a thread of the parent
    may have held at the fork).
    """

    def __init__(self, max_blocks: int, max_idle: int, export: bool = False) -> None:
        super().__init__()
        self.export = export
        """Results go to another process (a loader service's client), not into views here."""
        self.max_blocks = max_blocks
        self.on_release: Callable[[], None] | None = None
        """Called after a block is given back (from any thread): room was made."""
        self._maps: dict[str, mmap.mmap] = {}
        self._sizes: dict[str, int] = {}
        """Every block lent or free; size 0 while it is fresh (a decode process may be sizing
        it)."""
        self._descriptors: dict[str, int] = {}
        """What holds each block."""
        self._free: list[str] = []
        self._holds: dict[str, int] = {}
        """Holds on blocks with more than one (exported parts here and in a client)."""
        self._removed: list[str] = []
        """Exporting: names removed since the client was last told (it keeps blocks mapped)."""
        self._max_idle = max_idle
        """Bytes of idle blocks kept, at most: shared memory is memory too."""
        self._once: set[str] = set()
        """Blocks removed rather than kept when released."""
        self._lock = threading.Lock()
        self._closed = False
        self._most = max(max_blocks, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8)
        """Blocks at once, lent past `max_blocks` included."""
        reaper.start()  # releases from finalizers may go there

    def lease(self, once: bool = False) -> Slot | None:
        """A block for one task, or None when the descriptors blocks may take are spent (then
        the result is pickled). `once`: a fresh block, removed when released (a part of a
        batch: an odd size; past `max_blocks`)."""
        if self.foreign:  # a forked child: the blocks are the parent's
            return None
        with self._lock:
            if self._closed:
                return None
            if self._free and not once:
                name = self._free.pop()
                return Slot(name, self._sizes[name])
            if len(self._sizes) >= self._most:
                return None
            once = once or len(self._sizes) >= self.max_blocks
            name, self._descriptors[name] = shm.new_block()
            self._sizes[name] = 0
            if once:
                self._once.add(name)
            return Slot(name, 0)

    def release(self, name: str) -> None:
        """The task is over or the views are gone: the block (or the fresh one its process
        did not use, for a result too small to share) is free again."""
        if self.foreign:
            return
        with self._lock:
            self._release(name)
        self._released()

    def _released(self) -> None:
        if self.on_release is not None:
            self.on_release()

    def release_soon(self, name: str) -> None:
        """`release` from a finalizer (the last view of a block collected): in place if the
        lock is free at once, else on the reaper's thread; the collecting thread may be the
        one holding the lock."""
        if self.foreign:
            return
        if not self._lock.acquire(blocking=False):
            reaper.later(self.release, name)
            return
        try:
            self._release(name)
        finally:
            self._lock.release()
        self._released()

    def _release(self, name: str) -> None:
        if name not in self._sizes:
            return
        holds = self._holds.pop(name, 1) - 1
        if holds > 0:
            self._holds[name] = holds
            return
        idle_after = self.idle_bytes + self._sizes[name]
        # with a budget, the room is weighed after the release, when what waited for it asks
        over = idle_after > self._max_idle and self.on_release is None
        if self._closed or name in self._once or over:
            self._remove(name)
        elif name not in self._free:
            self._free.append(name)

    def retire(self, name: str) -> None:
        """Remove a block now: too small, or its task failed (a process still writing it keeps
        its memory only until it is done)."""
        if self.foreign:
            return
        with self._lock:
            self._remove(name)

    def adopt(self, items: list[Any], slot: Slot, here: bool = False) -> list[Any]:
        """A result's items with each SharedArray replaced by a view of the block; the block
        returns to the pool once every view is gone. Exporting, each item becomes an
        `Exported` part instead, which the process it is sent to maps (`views`), unless the
        items are for `here` (the parts of a batch joined in this process)."""
        export = self.export and not here
        with self._lock:
            block = self._maps.get(slot.name)
            if block is None:  # sized by the decode process just now
                block = self._maps[slot.name] = shm.attach_block(slot.name)
                self._sizes[slot.name] = len(block)
            if export and items:
                self._holds[slot.name] = len(items)
        if export:
            if not items:
                self.release(slot.name)
            parts = [Exported(slot.name, item) for item in items]
            for part in parts:
                weakref.finalize(part, self.release_soon, slot.name)
            return parts
        return cast(list[Any], views(block, items, lambda: self.release_soon(slot.name)))

    def hold(self, name: str) -> None:
        """One more hold on a block (an exported part sent to another process), dropped by
        `release`; the block is free once the last is."""
        with self._lock:
            if name in self._sizes:
                self._holds[name] = self._holds.get(name, 1) + 1

    def keep_idle(self, idle_bytes: int) -> None:
        """Keep at most `idle_bytes` of idle blocks from now on (the pass's room under its
        memory limit): the rest are removed, now and as they are released."""
        if self.foreign:
            return
        with self._lock:
            self._max_idle = idle_bytes
            while self._free and self.idle_bytes > idle_bytes:
                self._remove(self._free[0])

    def _remove(self, name: str) -> None:
        """Let go of a block; its memory goes when the last view of it does."""
        self._once.discard(name)
        self._maps.pop(name, None)
        self._sizes.pop(name, None)
        self._holds.pop(name, None)
        if self.export:
            self._removed.append(name)
        if name in self._free:
            self._free.remove(name)
        descriptor = self._descriptors.pop(name, -1)
        if descriptor >= 0:
            os.close(descriptor)

    def take_removed(self) -> list[str]:
        """Exporting: the blocks removed since the last call, which the client must stop
        mapping (a mapping would keep a removed block's memory)."""
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    @property
    def segments(self) -> int:
        return len(self._sizes)

    @property
    def bytes(self) -> int:
        """Bytes of the blocks that exist now."""
        return sum(self._sizes.values())

    @property
    def lent_bytes(self) -> int:
        """Bytes of the blocks holding a batch: being written, waiting, or viewed."""
        return self.bytes - self.idle_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of the blocks waiting to be lent again: memory kept, holding no batch."""
        return sum(self._sizes[name] for name in self._free)

    def close(self) -> None:
        """Let go of every block now; batches still held keep their memory until dropped."""
        if self.foreign:
            return
        with self._lock:
            self._closed = True
            for name in list(self._sizes):
                self._remove(name)
