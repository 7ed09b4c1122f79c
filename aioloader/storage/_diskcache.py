"""Remote bytes kept on local disk, least recently used evicted first, so that epoch 2 of a
remote dataset reads from disk."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

DEFAULT_LIMIT = 10 << 30


class DiskCache:
    """Files named by a hash of (URL, range) in `directory`, at most `limit` bytes in all.

    Several processes may share a directory: files appear by rename, so a reader never sees a
    half-written one, and a file another process evicted is simply a miss.
    """

    def __init__(self, directory: str | os.PathLike[str], limit: int = DEFAULT_LIMIT) -> None:
        if limit <= 0:
            raise ValueError(f"cache_limit must be a positive number of bytes, got {limit}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        entries = sorted(
            (entry.stat().st_mtime, entry.name, entry.stat().st_size)
            for entry in os.scandir(self.directory)
            if entry.is_file() and not entry.name.startswith(".")
        )
        self._sizes: OrderedDict[str, int] = OrderedDict((name, size) for _, name, size in entries)
        self.size = sum(self._sizes.values())
        self.hits = self.misses = 0

    def report(self) -> dict[str, float]:
        """Hits, misses and size, for loader.stats."""
        return {"disk_hits": self.hits, "disk_misses": self.misses,
                "disk_gib": round(self.size / (1 << 30), 4)}

    def path(self, url: str, start: int | None, end: int | None) -> Path:
        key = f"{url}\0{start}\0{end}".encode()
        return self.directory / hashlib.sha256(key).hexdigest()

    def get(self, path: Path) -> bytes | None:
        """The cached bytes, or None; a hit becomes the most recently used."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.misses += 1
            self._sizes.pop(path.name, None)
            return None
        self.hits += 1
        self._sizes.move_to_end(path.name)
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def put(self, path: Path, data: bytes) -> None:
        """Keep `data`, evicting the least recently used files to stay under the limit."""
        if len(data) > self.limit:
            return
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, prefix=".incoming-")
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
        self.size += len(data) - self._sizes.pop(path.name, 0)
        self._sizes[path.name] = len(data)
        while self.size > self.limit and self._sizes:
            name, size = self._sizes.popitem(last=False)
            self.size -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / name)
