"""Records at known byte ranges of files (MXNet RecordIO, TFRecord): a map-style dataset whose
fetch is one ranged read, unframed by the format."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from ..storage import _storage as storage
from ..storage._local import read_path
from .base import Dataset, digest
from .keys import KeyTable

READ_THREADS = 1
"""Records each decode process reads at once: one, as large local files are read (reading
several on threads while reads are slow waits on deciding by the read's time alone)."""


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
    _paths: list[str]
    """Each file's local path, where records are read in the decode processes."""

    def _set_records(self, per_file: list[FileRecords]) -> None:
        self._file: npt.NDArray[np.int32] = np.concatenate(
            [np.full(len(f.starts), n, np.int32) for n, f in enumerate(per_file)]
        )
        self._start = np.array([s for f in per_file for s in f.starts], dtype=np.int64)
        self._end = np.array([e for f in per_file for e in f.ends], dtype=np.int64)
        self._keys = KeyTable(k for f in per_file for k in f.keys)

    @staticmethod
    @abc.abstractmethod
    def unframe(data: bytes, url: str, start: int) -> bytes:
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

    def for_local_decode(self) -> Records | None:
        """Records of local files, read and unframed in the decode processes, as DataLoader's
        workers read theirs: the event loop only says where each one lies, and no byte of a
        record crosses to a decode process. None: a file is remote, so read here."""
        paths = [storage.local_path(url) for url in self.urls]
        if any(path is None for path in paths):
            return None
        copy_ = object.__new__(type(self))  # not copy.copy: a subclass may reduce otherwise
        copy_.__dict__.update(vars(self))
        copy_.reads_in_decode = copy_.batched_fetch = True
        copy_._paths = cast(list[str], paths)
        return copy_

    def load_in_workers(self) -> tuple[Callable[[Any], Any], int] | None:
        if not self.reads_in_decode:
            return None
        return functools.partial(_read_record, type(self).unframe), READ_THREADS

    def _where(self, index: int) -> tuple[str, int, int]:
        return (self._paths[self._file[index]], int(self._start[index]),
                int(self._end[index]))

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        return [self._where(index) for index in indices]

    async def fetch(self, index: int) -> Any:
        if self.reads_in_decode:
            return self._where(index)
        url = self.urls[self._file[index]]
        start, end = int(self._start[index]), int(self._end[index])
        async with storage.borrowed() as reads:
            data = await reads.read_range(url, start, end)
        return self.unframe(data, url, start)


def _read_record(unframe: Callable[[bytes, str, int], bytes], where: tuple[str, int, int]
                 ) -> bytes:
    """A record's payload, in a decode process: read from its file and unframed."""
    path, start, end = where
    return unframe(read_path(path, start, end), path, start)
