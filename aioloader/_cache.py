"""SharedCache: decoded samples in shared memory, used by every decode process.

Two segments in /dev/shm: an index (a header and one (offset, length) entry per sample) and the
data, filled front to back. A sample is stored the first time it is decoded, as a pickle with
its arrays out of band, and read back as read-only arrays over the shared memory, without a
copy. Once the data segment is full, further samples are simply not cached ("stochastic"
caching: which samples stay depends on the order they first came). Appends take an flock on the
index segment, so any process that maps the segments by name can share them.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pickle
import secrets
import struct
import weakref
from multiprocessing import resource_tracker
from typing import Any

from ._closing import Closing
from ._runtime.transport import SHM_DIR, available

_HEADER = struct.Struct("<qqqq")
"""capacity, bytes used, entries, full (0/1)."""
_ALIGN = 64


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class CachedSample:
    """Sent to a decode process in place of raw bytes: the sample is in the cache."""

    def __reduce__(self) -> str:
        return "CACHED"


CACHED = CachedSample()


class SharedCache(Closing):
    """Up to `size_limit_gib` GiB of decoded samples, shared by every decode process.

    Pass it as `Loader(..., decode=..., augment=..., cache=SharedCache(8))`: `decode` (raw bytes
    to, say, a uint8 image; no rng) runs once per sample and its output is cached; `augment`
    (the random part) runs every time on the cached value, which is read-only. Cached samples
    are not fetched again either. An unnamed cache belongs to its creator: close it (or use
    `with`) to remove its segments; Python's resource tracker removes them if the process dies.

    With a `name`, the training processes of one machine (one per GPU under torchrun) share
    one cache: the first to attach makes it, the others join it by name, and the last to
    detach removes it, also when the others crashed.
    """

    def __init__(self, size_limit_gib: float, name: str | None = None) -> None:
        if not available():
            raise RuntimeError("SharedCache needs /dev/shm (Linux)")
        if not size_limit_gib > 0:
            raise ValueError(f"size_limit_gib must be positive, got {size_limit_gib}")
        if name is not None and not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"a cache name takes letters, digits, - and _; got {name!r}")
        self.size_limit = int(size_limit_gib * (1 << 30))
        self.name = name
        token = f"/aioloader-cache-{name or f'{os.getpid()}-{secrets.token_hex(4)}'}"
        self.names = (token + "-index", token + "-data")
        self._members_fd = -1
        """Named caches: a shared flock on this file marks this process as attached."""
        self._remover: weakref.finalize[[tuple[str, str]], SharedCache] | None = None
        """Set in the process that made the segments: removes them on close or collection."""
        self._index: mmap.mmap | None = None
        self._data: mmap.mmap | None = None
        self._index_fd = -1
        self.hits = 0
        self.misses = 0

    # -- set-up -----------------------------------------------------------------------------

    def attach(self, capacity: int) -> None:
        """Create the segments for sample indices 0..capacity-1, or, for a named cache that
        another process on this machine made already, join it."""
        if self._index is None and self.name is not None:
            self._join(capacity)
        elif self._index is None:
            self._create(capacity)
            self._remover = weakref.finalize(self, _remove, self.names)
            for segment in self.names:
                resource_tracker.register(segment, "shared_memory")
        if capacity > self.capacity:
            raise ValueError(
                f"this cache holds indices below {self.capacity}; the dataset has {capacity}"
            )

    def _join(self, capacity: int) -> None:
        """Attach to the named cache, making it if no process is attached (a cache left by
        processes that all died is made anew). Attached processes hold a shared flock on the
        members file; the kernel drops it when a process dies, so the last one to leave, even
        after crashes of the others, sees it is alone and removes the segments."""
        members = os.open(SHM_DIR + self.names[0][: -len("-index")] + "-members",
                          os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
            alone = True
        except BlockingIOError:
            alone = False
        if alone:
            _remove_files(self.names)  # whatever is there belonged to no live process
            self._create(capacity)
        fcntl.flock(members, fcntl.LOCK_SH)
        self._members_fd = members
        self._map()

    def _create(self, capacity: int) -> None:
        index_bytes = _HEADER.size + 16 * capacity
        for name, size in zip(self.names, (index_bytes, self.size_limit), strict=True):
            descriptor = os.open(SHM_DIR + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(descriptor, size)  # sparse: untouched pages cost nothing
            os.close(descriptor)
        self._map()
        assert self._index is not None
        _HEADER.pack_into(self._index, 0, capacity, 0, 0, 0)

    def _map(self) -> None:
        if self._index is not None:
            return
        self._index_fd = os.open(SHM_DIR + self.names[0], os.O_RDWR)
        self._index = mmap.mmap(self._index_fd, 0)
        with open(SHM_DIR + self.names[1], "r+b") as file:
            self._data = mmap.mmap(file.fileno(), 0)

    def __getstate__(self) -> dict[str, Any]:
        """Decode processes get the names and map the segments themselves."""
        return {"size_limit": self.size_limit, "names": self.names}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.size_limit, self.names = state["size_limit"], state["names"]
        self.name, self._members_fd, self._remover = None, -1, None
        self._index, self._data, self._index_fd = None, None, -1
        self.hits = self.misses = 0

    # -- use --------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._header()[0]

    def _header(self) -> tuple[int, int, int, int]:
        self._map()
        assert self._index is not None
        capacity, used, entries, full = _HEADER.unpack_from(self._index, 0)
        return capacity, used, entries, full

    def _entry(self, index: int) -> tuple[int, int]:
        assert self._index is not None
        offset, length = struct.unpack_from("<qq", self._index, _HEADER.size + 16 * index)
        return offset, length

    def __contains__(self, index: int) -> bool:
        self._map()
        return 0 <= index < self.capacity and self._entry(index)[1] > 0

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
        memory = memoryview(self._data).toreadonly()
        header_length, count = struct.unpack_from("<qq", memory, offset)
        lengths = struct.unpack_from(f"<{count}q", memory, offset + 16)
        position = offset + 16 + 8 * count
        header = memory[position : position + header_length]
        position = _aligned(position + header_length)
        buffers = []
        for size in lengths:
            buffers.append(memory[position : position + size])
            position = _aligned(position + size)
        return pickle.loads(header, buffers=buffers)

    def put(self, index: int, value: Any) -> bool:
        """Store `value` for `index` unless it is there already or does not fit; True if
        stored. Safe to call from several processes at once."""
        self._map()
        if not 0 <= index < self.capacity:
            return False
        buffers: list[pickle.PickleBuffer] = []
        header = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        total = _aligned(16 + 8 * len(raws) + len(header)) + sum(_aligned(r.nbytes) for r in raws)
        offset = self._reserve(index, total)
        if offset < 0:
            return False
        assert self._data is not None and self._index is not None
        struct.pack_into(f"<qq{len(raws)}q", self._data, offset, len(header), len(raws),
                         *(r.nbytes for r in raws))
        position = offset + 16 + 8 * len(raws)
        self._data[position : position + len(header)] = header
        position = _aligned(position + len(header))
        for raw in raws:
            self._data[position : position + raw.nbytes] = raw.cast("B")
            position = _aligned(position + raw.nbytes)
        struct.pack_into("<q", self._index, _HEADER.size + 16 * index + 8, total)  # publish
        return True

    def _reserve(self, index: int, total: int) -> int:
        """The offset for `total` bytes, or -1: cached already, being written, or full."""
        assert self._index is not None
        fcntl.flock(self._index_fd, fcntl.LOCK_EX)
        try:
            capacity, used, entries, full = _HEADER.unpack_from(self._index, 0)
            if self._entry(index)[1] != 0 or full:
                return -1
            if used + total > self.size_limit:
                _HEADER.pack_into(self._index, 0, capacity, used, entries, 1)
                return -1
            struct.pack_into("<qq", self._index, _HEADER.size + 16 * index, used, -1)
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
        """Unmap, and remove the segments if this process made them."""
        for block in (self._index, self._data):
            if block is not None:
                with contextlib.suppress(BufferError):  # arrays still viewing it keep it
                    block.close()
        if self._index_fd >= 0:
            os.close(self._index_fd)
        self._index, self._data, self._index_fd = None, None, -1
        if self._remover is not None:
            self._remover()
        if self._members_fd >= 0:
            self._leave()

    def _leave(self) -> None:
        """Detach from a named cache; the last process attached removes it."""
        members, self._members_fd = self._members_fd, -1
        fcntl.flock(members, fcntl.LOCK_UN)
        try:
            fcntl.flock(members, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # others are still attached
        else:
            _remove_files(self.names)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR + self.names[0][: -len("-index")] + "-members")
        finally:
            os.close(members)


def _remove_files(names: tuple[str, str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR + name)


def _remove(names: tuple[str, str]) -> None:
    _remove_files(names)
    for name in names:
        resource_tracker.unregister(name, "shared_memory")
