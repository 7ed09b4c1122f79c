"""Records at known byte ranges of files (MXNet RecordIO, TFRecord): a map-style dataset whose
fetch is one ranged read, unframed by the format."""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..storage import _storage as storage
from .base import Dataset, digest
from .keys import KeyTable


@dataclass
class FileRecords:
    """Where a file's records lie: each one's first byte, the byte after it, and its key."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)


class Records(Dataset):
    """Subclass with `unframe`, and call `_set_records` with each file's records. Reads of
    consecutive records in one batch are merged into one request by the storage."""

    urls: list[str]

    def _set_records(self, per_file: list[FileRecords]) -> None:
        self._file: npt.NDArray[np.int32] = np.concatenate(
            [np.full(len(f.starts), n, np.int32) for n, f in enumerate(per_file)]
        )
        self._start = np.array([s for f in per_file for s in f.starts], dtype=np.int64)
        self._end = np.array([e for f in per_file for e in f.ends], dtype=np.int64)
        self._keys = KeyTable(k for f in per_file for k in f.keys)

    @abc.abstractmethod
    def unframe(self, data: bytes, url: str, start: int) -> bytes:
        """A record's payload from its bytes (read from `start` of `url`), checked."""

    def __len__(self) -> int:
        return len(self._start)

    def key(self, index: int) -> str:
        return f"{self.urls[self._file[index]]}#{self._keys[index]}"

    def fingerprint(self) -> dict[str, Any]:
        """The length and a digest of each record's file, place and key: what a position
        means, wherever the files are."""
        return {"length": len(self), "records": self._records_digest}

    @functools.cached_property
    def _records_digest(self) -> str:
        """Made once: the index never changes after construction."""
        return digest(self._file, self._start, self._end, self._keys.digest)

    async def fetch(self, index: int) -> bytes:
        url = self.urls[self._file[index]]
        start, end = int(self._start[index]), int(self._end[index])
        async with storage.borrowed() as reads:
            data = await reads.read_range(url, start, end)
        return self.unframe(data, url, start)
