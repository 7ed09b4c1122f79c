"""SharedCache: decoded samples in shared memory, used by every decode process.

Two segments: an index (a header and one (offset, length) entry per sample) and the data,
filled front to back. A sample is stored the first time it is decoded and read back as
read-only arrays over the shared memory, without a copy. Once the data segment is full, further
samples are simply not cached ("stochastic" caching: which samples stay depends on the order
they first came). Appends take an flock on the index segment, so any process that maps the
segments can share them.

The cache holds data, never code: an entry is a JSON description of the value (arrays, numpy
scalars, bytes, str, numbers, None, and lists, tuples and dicts of these) plus raw buffers, so
reading a cache cannot run anything; an entry that points outside its segment is a miss, one
that does not parse a CorruptEntry error. A named cache's segments in /dev/shm are used only
after checking that they are this user's, with mode 0600; pages are reserved before they are
written, so memory that runs out stops the caching instead of killing a process with SIGBUS.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import struct
import warnings
import weakref
from typing import Any

import numpy as np
import numpy.typing as npt

from ._closing import Closing
from ._ipc import shm
from ._processes.zygote import Zygote

_HEADER = struct.Struct("<qqqq")
"""capacity, bytes used, entries, full (0/1)."""
_ENTRY = struct.Struct("<qq")
_DESCRIPTION = struct.Struct("<q")
_ALIGN = 64


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class CachedSample:
    """Sent to a decode process in place of raw bytes: the sample is in the cache."""

    def __reduce__(self) -> str:
        return "CACHED"


CACHED = CachedSample()


class Uncacheable(TypeError):
    """A value holds something the cache does not store (only data: arrays, numbers, text...)."""


class CorruptEntry(ValueError):
    """A cache entry that does not describe a value inside its segment."""


def _describe(value: Any, buffers: list[memoryview]) -> Any:
    """A JSON-able description of `value`, its arrays and bytes appended to `buffers`."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, (bytes, bytearray)):
        buffers.append(memoryview(value))
        return {"b": len(buffers) - 1}
    if isinstance(value, np.ndarray | np.generic):
        array = np.ascontiguousarray(value)
        if array.dtype.hasobject:
            raise Uncacheable("arrays of Python objects")
        buffers.append(array.reshape(-1).view(np.uint8).data)
        kind = "a" if isinstance(value, np.ndarray) else "g"
        return {kind: [len(buffers) - 1, array.dtype.str, list(array.shape)]}
    if type(value) in (list, tuple):
        return {"l" if type(value) is list else "t": [_describe(v, buffers) for v in value]}
    if type(value) is dict and all(isinstance(k, (str, int)) for k in value):
        return {"d": [[k, _describe(v, buffers)] for k, v in value.items()]}
    raise Uncacheable(type(value).__name__)


def _rebuild(description: Any, buffers: list[memoryview]) -> Any:
    (kind, content), = description.items()
    if kind == "v":
        return content
    if kind == "b":
        return bytes(buffers[content])
    if kind in ("a", "g"):
        number, dtype, shape = content
        if not isinstance(dtype, str) or np.dtype(dtype).hasobject:
            raise ValueError(f"not a plain dtype: {dtype!r}")
        array: npt.NDArray[Any] = np.frombuffer(buffers[number], np.dtype(dtype)).reshape(shape)
        return array if kind == "a" else array[()]
    if kind in ("l", "t"):
        items = [_rebuild(v, buffers) for v in content]
        return items if kind == "l" else tuple(items)
    if kind == "d":
        return {k: _rebuild(v, buffers) for k, v in content}
    raise ValueError(f"unknown cache entry kind {kind!r}")


def _read(memory: memoryview) -> Any:
    """The value of one entry; its description and buffers must lie within `memory`."""
    (size,) = _DESCRIPTION.unpack_from(memory, 0)
    if not 0 <= size <= len(memory) - _DESCRIPTION.size:
        raise ValueError(f"a description of {size} bytes in an entry of {len(memory)}")
    entry = json.loads(bytes(memory[_DESCRIPTION.size : _DESCRIPTION.size + size]))
    base = _aligned(_DESCRIPTION.size + size)
    buffers = []
    for start, length in entry["buffers"]:
        if not (type(start) is int and type(length) is int
                and start >= 0 and 0 <= length <= len(memory) - base - start):
            raise ValueError(f"a buffer of {length} bytes at {start} is not in the entry")
        buffers.append(memory[base + start : base + start + length])
    return _rebuild(entry["value"], buffers)


class SharedCache(Closing):
    """Up to `size_limit_gib` GiB of decoded samples, shared by every decode process.

    Pass it as `Loader(..., decode=..., augment=..., cache=SharedCache(8))`: `decode` (raw bytes
    to, say, a uint8 image; no rng) runs once per sample and its output is cached; `augment`
    (the random part) runs every time on the cached value, which is read-only. Cached samples
    are not fetched again either. An unnamed cache belongs to its creator: its memory is held
    by the creator's descriptors (no name in /dev/shm), and goes with `close()` (or `with`), or
    with the creator's end, once no process maps it.

    With a `name`, the training processes of one machine (one per GPU under torchrun) share
    one cache: the first to attach makes it, the others join it by name, and the last to
    detach removes it, also when the others crashed or were killed. Segments that exist under
    the name but are not this user's (mode 0600) are refused.
    """

    def __init__(self, size_limit_gib: float, name: str | None = None) -> None:
        if not shm.available():
            raise RuntimeError("SharedCache needs /dev/shm (Linux)")
        if not size_limit_gib > 0:
            raise ValueError(f"size_limit_gib must be positive, got {size_limit_gib}")
        if name is not None and not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a cache name takes letters, digits, - and _; got {name!r}")
        self.size_limit = int(size_limit_gib * (1 << 30))
        free = shm.free_bytes()
        if name is not None and self.size_limit > free:
            raise ValueError(
                f"a SharedCache of {self.size_limit / 2**30:.2f} GiB does not fit in /dev/shm, "
                f"which has {free / 2**30:.2f} GiB free; ask for less, or grow /dev/shm "
                "(docker run --shm-size=...)"
            )
        self.name = name
        stem = f"aioloader-u{os.geteuid()}-cache-{name}"
        self.names = (stem + "-index", stem + "-data") if name else ("", "")
        """Named: the segments' names in /dev/shm. Unnamed: the blocks' tokens, once made."""
        self._by_name = name is not None
        self._members_fd = -1
        """Named caches: a shared flock on this file marks this process as attached."""
        self._remover: weakref.finalize[[tuple[int, ...]], SharedCache] | None = None
        """Set in the process that made an unnamed cache: lets go of its blocks on close or
        collection."""
        self._index: mmap.mmap | None = None
        self._data: mmap.mmap | None = None
        self._index_fd = -1
        self._data_fd = -1
        self.hits = 0
        self.misses = 0
        self.uncacheable = 0
        self._copy = False
        """Unpickled in another process: the segments were made by the process that sent it."""

    # -- set-up -----------------------------------------------------------------------------

    def attach(self, capacity: int) -> None:
        """Create the segments for sample indices 0..capacity-1, or, for a named cache that
        another process on this machine made already, join it."""
        if self._index is None and self.name is not None:
            self._join(capacity)
            Zygote.get().watch_cache(self.name, True)
        elif self._index is None and self._remover is None and self._copy:
            self._map()  # a copy sent to a loader service: the segments exist
        elif self._index is None:
            self._create(capacity)
            self._remover = weakref.finalize(self, _close_all, (self._index_fd, self._data_fd))
        if capacity > self.capacity:
            raise ValueError(
                f"this cache holds indices below {self.capacity}; the dataset has {capacity}"
            )

    def _join(self, capacity: int) -> None:
        """Attach to the named cache, making it if no process is attached (a cache left by
        processes that all died is made anew). Attached processes hold a shared flock on the
        members file; the kernel drops it when a process dies, so the last one to leave, even
        after crashes of the others, sees it is alone and removes the segments."""
        assert self.name is not None
        members = _open_members(self.name)
        try:
            fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        try:
            if alone:
                for segment in self.names:  # another user's files under our names: refuse
                    shm.refuse_foreign(segment)
                _remove_files(self.names)  # ours, left by processes that are gone
                self._create(capacity)
            fcntl.flock(members, fcntl.LOCK_SH)
            self._map()
        except BaseException:
            os.close(members)
            raise
        self._members_fd = members

    def _create(self, capacity: int) -> None:
        index_bytes = _HEADER.size + _ENTRY.size * capacity
        if self._by_name:
            shm.create(self.names[0], index_bytes)
            shm.create(self.names[1], self.size_limit, reserved=False)  # filled lazily
        else:  # blocks: nothing left behind whatever ends this process
            (index, self._index_fd), (data, self._data_fd) = shm.new_block(), shm.new_block()
            self.names = (index, data)
            shm.reserve(self._index_fd, 0, index_bytes)
            os.ftruncate(self._data_fd, self.size_limit)  # filled lazily
        self._map()
        assert self._index is not None
        _HEADER.pack_into(self._index, 0, capacity, 0, 0, 0)

    def _map(self) -> None:
        if self._index is not None:
            return
        if self._index_fd < 0:
            opening = shm.open_owned if self._by_name else shm.open_block
            self._index_fd = opening(self.names[0])
            self._data_fd = opening(self.names[1])
        self._index = mmap.mmap(self._index_fd, 0)
        self._data = mmap.mmap(self._data_fd, 0)
        self.size_limit = len(self._data)  # a named cache has the size its maker gave it

    def __getstate__(self) -> dict[str, Any]:
        """Decode processes get the names and map the segments themselves."""
        return {"size_limit": self.size_limit, "names": self.names,
                "by_name": self._by_name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.size_limit, self.names = state["size_limit"], state["names"]
        self._by_name = state["by_name"]
        self.name, self._members_fd, self._remover = None, -1, None
        self._index, self._data, self._index_fd, self._data_fd = None, None, -1, -1
        self.hits = self.misses = self.uncacheable = 0
        self._copy = True

    # -- use --------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Indices below this have an entry: the header's count, within the index segment."""
        return min(self._header()[0], self._slots())

    def _slots(self) -> int:
        assert self._index is not None
        return (len(self._index) - _HEADER.size) // _ENTRY.size

    def _header(self) -> tuple[int, int, int, int]:
        self._map()
        assert self._index is not None
        capacity, used, entries, full = _HEADER.unpack_from(self._index, 0)
        return capacity, used, entries, full

    def _entry(self, index: int) -> tuple[int, int]:
        """(offset, length) of `index`'s value, (0, 0) if it has no entry."""
        assert self._index is not None
        if not 0 <= index < self._slots():
            return 0, 0
        offset, length = _ENTRY.unpack_from(self._index, _HEADER.size + _ENTRY.size * index)
        return offset, length

    def _inside(self, offset: int, length: int) -> bool:
        """Whether an entry lies in the data segment: one that does not is a miss."""
        assert self._data is not None
        return length > 0 and 0 <= offset <= len(self._data) - length

    def __contains__(self, index: int) -> bool:
        self._map()
        return 0 <= index < self.capacity and self._inside(*self._entry(index))

    def lookup(self, index: int) -> bool:
        """Whether `index` is cached, counted as a hit or a miss (the loader asks this)."""
        found = index in self
        if found:
            self.hits += 1
        else:
            self.misses += 1
        return found

    def get(self, index: int) -> Any:
        """The cached value of `index`, its arrays read-only views of the shared memory."""
        self._map()
        offset, length = self._entry(index)
        if length <= 0:
            raise KeyError(index)
        assert self._data is not None
        try:
            if not self._inside(offset, length):
                raise ValueError(f"{length} bytes at {offset} are not in the data segment")
            return _read(memoryview(self._data).toreadonly()[offset : offset + length])
        except (ValueError, TypeError, LookupError, AttributeError, RecursionError,
                struct.error) as e:
            raise CorruptEntry(
                f"the cache entry of sample {index} is corrupt ({type(e).__name__}: {e}); "
                "remove the cache's segments to start it afresh"
            ) from None

    def put(self, index: int, value: Any) -> bool:
        """Store `value` for `index` unless it is there already, does not fit, or is not data;
        True if stored. Safe to call from several processes at once."""
        self._map()
        if not 0 <= index < self.capacity:
            return False
        buffers: list[memoryview] = []
        try:
            description = _describe(value, buffers)
        except Uncacheable as e:
            self._refuse(e)
            return False
        places, position = [], 0
        for buffer in buffers:
            places.append([position, buffer.nbytes])
            position = _aligned(position + buffer.nbytes)
        text = json.dumps({"value": description, "buffers": places}).encode()
        base = _aligned(_DESCRIPTION.size + len(text))
        offset = self._reserve(index, base + position)
        if offset < 0:
            return False
        assert self._data is not None and self._index is not None
        _DESCRIPTION.pack_into(self._data, offset, len(text))
        self._data[offset + _DESCRIPTION.size : offset + _DESCRIPTION.size + len(text)] = text
        for (start, size), buffer in zip(places, buffers, strict=True):
            self._data[offset + base + start : offset + base + start + size] = buffer.cast("B")
        _ENTRY.pack_into(self._index, _HEADER.size + _ENTRY.size * index, offset, base + position)
        return True

    def _refuse(self, error: Uncacheable) -> None:
        if not self.uncacheable:
            warnings.warn(
                f"SharedCache stores data only (arrays, numbers, str, bytes, None, and lists, "
                f"tuples and dicts of them); a decoded value holds {error}, so it is not "
                "cached. Return plain data from decode= to cache it.",
                stacklevel=4,
            )
        self.uncacheable += 1

    def _reserve(self, index: int, total: int) -> int:
        """The offset for `total` bytes with their pages allocated, or -1: cached already,
        being written, or full (also when /dev/shm has no room left)."""
        assert self._index is not None
        fcntl.flock(self._index_fd, fcntl.LOCK_EX)
        try:
            capacity, used, entries, full = _HEADER.unpack_from(self._index, 0)
            if self._entry(index)[1] != 0 or full:
                return -1
            if not 0 <= used <= self.size_limit - total:  # full, or a corrupt header
                _HEADER.pack_into(self._index, 0, capacity, used, entries, 1)
                return -1
            try:
                shm.reserve(self._data_fd, used, total)
            except shm.NoSpace:
                _HEADER.pack_into(self._index, 0, capacity, used, entries, 1)
                return -1
            _ENTRY.pack_into(self._index, _HEADER.size + _ENTRY.size * index, used, -1)
            _HEADER.pack_into(self._index, 0, capacity, used + total, entries + 1, full)
            return int(used)
        finally:
            fcntl.flock(self._index_fd, fcntl.LOCK_UN)

    def report(self) -> dict[str, float]:
        """Size, fill and hit rate, for loader.stats."""
        _, used, entries, full = self._header()
        asked = self.hits + self.misses
        return {
            "size_limit_gib": self.size_limit / (1 << 30),
            "used_gib": round(used / (1 << 30), 4),
            "fill": round(used / self.size_limit, 4),
            "samples": entries,
            "full": full,
            "hit_rate": round(self.hits / asked, 4) if asked else 0.0,
        }

    def close(self) -> None:
        """Unmap, and remove the segments if this process made them (or, for a named cache,
        was the last member)."""
        for block in (self._index, self._data):
            if block is not None:
                with contextlib.suppress(BufferError):  # arrays still viewing it keep it
                    block.close()
        if self._remover is None:
            _close_all((self._index_fd, self._data_fd))
        if self._remover is not None:
            self._remover()  # the maker's descriptors: the blocks go with the last mapping
        self._index, self._data, self._index_fd, self._data_fd = None, None, -1, -1
        if self._members_fd >= 0:
            self._leave()

    def _leave(self) -> None:
        """Detach from a named cache; the last process attached removes it."""
        assert self.name is not None
        members, self._members_fd = self._members_fd, -1
        fcntl.flock(members, fcntl.LOCK_UN)
        os.close(members)
        remove_if_unused(self.name)
        zygote = Zygote.running()
        if zygote is not None:
            zygote.watch_cache(self.name, False)


def _members_name(name: str) -> str:
    return f"aioloader-u{os.geteuid()}-cache-{name}-members"


def _open_members(name: str, create: bool = True) -> int:
    try:
        descriptor = os.open(shm.path(_members_name(name)),
                             (os.O_CREAT if create else 0) | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    except OSError:
        shm.refuse_foreign(_members_name(name))  # a symlink or another user's file: say so
        raise
    try:
        shm.check_owned(descriptor, _members_name(name))
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def remove_if_unused(name: str) -> None:
    """Remove a named cache if no live process is attached to it (a zygote may ask after
    the last member removed it: the members file is not made again then)."""
    try:
        members = _open_members(name, create=False)
    except OSError:
        return
    try:
        fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return  # others are still attached
    else:
        stem = f"aioloader-u{os.geteuid()}-cache-{name}"
        _remove_files((stem + "-index", stem + "-data", _members_name(name)))
    finally:
        os.close(members)


def _close_all(descriptors: tuple[int, ...]) -> None:
    for descriptor in descriptors:
        if descriptor >= 0:
            os.close(descriptor)


def _remove_files(names: tuple[str, ...]) -> None:
    for name in names:
        shm.unlink(name)
