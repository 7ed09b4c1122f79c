"""Remote bytes kept on local disk, the oldest written evicted first, so that epoch 2 of a
remote dataset reads from disk.

Each entry keeps the version (ETag, Last-Modified, size) of the object its bytes came from. A
job (one DiskCache: a Loader, or a node's service) serves an entry as it is only once it has
seen that version of the object itself: from the server's answer when it read the bytes, or
from a 304 to a conditional request (`Storage`), one per object per job. A folder outlives
jobs, and objects change between them: a new job must not get the old bytes.

Oldest-written rather than least-recently-used: an epoch reads every sample once, so the two
evict alike, and least-recently-used makes every hit a write to the shared index (a hit costs
four to five times more, and processes queue for SQLite's one writer).

The index is diskcache's SQLite database, so any number of processes and threads may share a
folder: a read sees a whole value or none, and eviction and size are counted in one place for
all of them. Values under 32 KiB live in the database, larger ones in files it names. A
process killed while writing leaves at most a value file that no row names yet; the next
DiskCache removes it once it is older than a live writer's could be.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sqlite3
import threading
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import diskcache
from diskcache.core import DBNAME, UNKNOWN

from ._version import Version

DEFAULT_LIMIT = 10 << 30
DEBRIS_AGE = 600.0
"""Seconds after which a value file that no row names is a crashed writer's: a live writer
names its file at most diskcache's 60 s lock timeout after writing its last byte."""
_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")
_OLD_FILE = re.compile(r"[0-9a-f]{64}|\.incoming-[^/]*")
"""The files of this cache before it had an index: nothing reads them any more."""


class _Disk(diskcache.Disk):  # type: ignore[misc]
    """diskcache's value files, written in large chunks (not line by line) and removed again
    when their row never comes: a failed write must not leave a file nobody counts."""

    def __init__(self, directory: str, **settings: Any) -> None:
        super().__init__(directory, **settings)
        self._new = threading.local()

    def filename(self, key: Any = UNKNOWN, value: Any = UNKNOWN) -> tuple[str, str]:
        name, full_path = super().filename(key, value)
        self._new.path = full_path
        return name, full_path

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> Any:
        self._new.path = None
        if type(value) is bytes and len(value) >= self.min_file_size:
            value, read = io.BytesIO(value), True
        try:
            return super().store(value, read, key=key)
        except BaseException:
            self.discard_new()
            raise

    def discard_new(self) -> None:
        """Remove the file this thread's last store wrote: its row was not written."""
        path, self._new.path = getattr(self._new, "path", None), None
        if path is not None:
            with contextlib.suppress(OSError):
                os.remove(path)


class Entry(NamedTuple):
    """A cached value: its bytes, their version, and whether to serve it without asking."""

    data: bytes
    version: Version | None
    """The object's version the bytes came from; None in an entry of an older release."""
    trusted: bool
    """This job has seen that version of the object: serve the bytes without asking."""


class DiskCache:
    """At most `limit` bytes (index included) of remote bytes in `directory`, by (URL, start,
    end), each with its object's version; any number of processes and threads may share the
    folder.

    A cache error (a full disk, a locked or unreadable index) is counted, warned about once and
    never raised: a failed read is a miss, a failed write loses only the copy, and an index
    that cannot be opened (that needs a write too) leaves every read to the network.
    """

    def __init__(self, directory: str | os.PathLike[str], limit: int = DEFAULT_LIMIT) -> None:
        if limit <= 0:
            raise ValueError(f"cache_limit must be a positive number of bytes, got {limit}")
        self.directory = Path(directory)
        self.limit = limit
        self._lock = threading.Lock()
        self.hits = self.misses = self.read_errors = self.write_errors = 0
        self.checked = self.replaced = 0
        self._seen: dict[str, str] = {}
        """URL -> the version (as stored) this job last saw of the object."""
        self._warned: set[str] = set()
        self.size = 0
        self._cache: diskcache.Cache | None = None
        try:
            self._cache = diskcache.Cache(  # the write-ahead log shrinks back after a burst
                str(self.directory), size_limit=limit, eviction_policy="least-recently-stored",
                disk=_Disk, sqlite_journal_size_limit=4 << 20,
            )
            self.size = self._cache.volume()
            remove_debris(self.directory)
        except _ERRORS as error:
            self._failed("write", error)

    def __len__(self) -> int:
        return 0 if self._cache is None else len(self._cache)

    def report(self) -> dict[str, float]:
        """Hits (of which checked by a 304), misses (of which entries read again), size and
        failures, for loader.stats."""
        return {"disk_hits": self.hits, "disk_checked": self.checked,
                "disk_misses": self.misses, "disk_replaced": self.replaced,
                "disk_gib": round(self.size / (1 << 30), 4),
                "disk_read_errors": self.read_errors, "disk_write_errors": self.write_errors}

    def get(self, url: str, start: int | None, end: int | None) -> Entry | None:
        """The cached bytes and their version, or None. A hit is counted for a trusted entry;
        an untrusted one counts as what `checked` or `put` makes of it."""
        value: bytes | None = None
        tag: str | None = None
        try:
            if self._cache is not None:
                value, tag = self._cache.get(_key(url, start, end), tag=True)
        except _ERRORS as error:
            self._failed("read", error)
            value = None
        with self._lock:
            if value is None:
                self.misses += 1
                return None
            trusted = tag is not None and self._seen.get(url) == tag
            self.hits += trusted
        return Entry(value, None if tag is None else Version(*json.loads(tag)), trusted)

    def checked_unchanged(self, url: str, version: Version) -> None:
        """The server answered 304 to a conditional request: `version` is the object's."""
        with self._lock:
            self._seen[url] = _tag(version)
            self.hits += 1
            self.checked += 1

    def put(self, url: str, start: int | None, end: int | None, data: bytes, version: Version,
            replacing: bool = False) -> None:
        """Keep `data`, read from the server as `version` of the object (`replacing` an entry
        it did not serve: changed, or not to be checked), evicting the oldest written to stay
        under the limit."""
        tag = _tag(version)
        with self._lock:
            self._seen[url] = tag
            self.replaced += replacing
            self.misses += replacing  # its get counted nothing
        if len(data) > self.limit or self._cache is None:
            return
        try:
            self._cache.set(_key(url, start, end), data, tag=tag)
        except _ERRORS as error:
            self._cache.disk.discard_new()
            self._failed("write", error)
            return
        try:
            size = self._cache.volume()
            if size > self.limit:  # diskcache evicts 10 entries a write: maybe not enough
                self._cache.cull()
                size = self._cache.volume()
        except _ERRORS as error:
            self._failed("write", error)
            return
        self.size = size

    def _failed(self, what: str, error: BaseException) -> None:
        with self._lock:
            if what == "read":
                self.read_errors += 1
            else:
                self.write_errors += 1
            first = what not in self._warned
            self._warned.add(what)
        if first:
            warnings.warn(
                f"disk cache {self.directory}: a {what} failed ({type(error).__name__}: "
                f"{error}); reads go on from the network (said once, counted in "
                f"stats.cache['disk_{what}_errors'])",
                RuntimeWarning, stacklevel=3,
            )


def _tag(version: Version) -> str:
    """A version as the index's tag column holds it, beside the bytes it labels."""
    return json.dumps([version.etag, version.last_modified, version.size])


def _key(url: str, start: int | None, end: int | None) -> str:
    """(URL, start, end) as text, which diskcache stores as it is (a tuple it pickles, at a
    third of the cost of a read); start and end hold no space, so no two triples share one."""
    return f"{start} {end} {url}"


def remove_debris(directory: Path, age: float = DEBRIS_AGE) -> None:
    """Remove value files that no row names and nobody wrote for `age` seconds (left by a
    process killed between writing a file and naming it), and files of the old format."""
    old = time.time() - age
    unnamed: list[str] = []
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            if _OLD_FILE.fullmatch(relative):
                unnamed.append(relative)
            elif _VALUE_FILE.fullmatch(relative):
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                    if os.stat(path).st_mtime < old:
                        unnamed.append(relative)
    if not unnamed:
        return
    with contextlib.closing(sqlite3.connect(directory / DBNAME, timeout=60)) as index:
        named = {row[0].replace(os.sep, "/") for row in index.execute(
            "SELECT filename FROM Cache WHERE filename IS NOT NULL")}
    for relative in unnamed:
        if relative not in named:
            with contextlib.suppress(OSError):
                os.remove(directory / relative)
