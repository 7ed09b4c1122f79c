"""TFRecord files from every store, by an index beside each file or made by one scan and kept:
as a map-style dataset (a ranged read per record, neighbours merged), or as a stream read file
by file, as tf.data reads them, which compressed files need."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np

from .._blocking import off_loop
from .._errors import FetchError
from .._loopthread import run_sync
from .._tar import READABLE
from ..storage import _storage as storage
from ..tfrecord import FRAMING, HEADER, TFRecordError, read_index, record_size, unframe
from .compressed import Scan, content_range
from .indexed import IndexedStream
from .kept import index_folder, keep, kept_path
from .records import FileRecords, Records
from .streaming import expand_braces

INDEX_SUFFIX = ".idx"
"""An index beside its file: `train-00000.tfrecord.idx` (DALI's `tfrecord2idx` format)."""
SCANS_AT_ONCE = 8


class TFRecord(Records):
    """The records of one or several `.tfrecord` files (brace patterns too); `fetch(i)` gives
    record i's data (a serialized `tf.train.Example`, which `aioloader.tfrecord.parse_example`
    reads in decode), its length and data checked by their masked CRC-32C.

    Each record is one ranged read, and reads of consecutive records in one batch are merged.
    Where each record lies comes from `index_urls` (one per file, DALI's `tfrecord2idx`
    format: "offset size" per line), else from `FILE.idx` beside each file, else from one scan
    of the file, kept in `index_dir` (default: aioloader's folder in the user's cache) keyed by
    the file's URL and size. An epoch divides by records, so a job resumes on any world size.
    A compressed file (TensorFlow's GZIP) has no ranges to read: it is refused, naming
    `TFRecordStream`, which reads it.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        index_urls: str | Sequence[str] | None = None,
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.urls = _expanded(urls)
        indexes = None if index_urls is None else _expanded(index_urls)
        if not self.urls:
            raise ValueError("TFRecord needs at least one .tfrecord file")
        if indexes is not None and len(indexes) != len(self.urls):
            raise ValueError(f"got {len(indexes)} index files for {len(self.urls)} .tfrecord "
                             "files; give one each")
        for url in self.urls + (indexes or []):
            storage.check_url(url)
        folder = index_folder(index_dir, "tfrecord-index")
        loaded = run_sync(_load(self.urls, indexes, folder))
        for url, (_, compression) in zip(self.urls, loaded, strict=True):
            if compression is not None:
                raise TFRecordError(f"{url}: a {compression}-compressed TFRecord file has no "
                                    "records to read by range: read it with "
                                    "aioloader.TFRecordStream, or decompress it")
        self._set_records([records for records, _ in loaded])

    @staticmethod
    def unframe(data: bytes, url: str, start: int) -> bytes:
        payload, size = unframe(data, url, start)
        if size != len(data):
            raise TFRecordError(f"{url}: the record at offset {start} takes {size} bytes where "
                                f"its index says {len(data)}: the index does not fit the file")
        return payload


def _expanded(urls: str | Sequence[str]) -> list[str]:
    return [url for pattern in ([urls] if isinstance(urls, str) else urls)
            for url in expand_braces(pattern)]


Indexed = tuple[FileRecords, str | None]
"""A file's records (in its decompressed content, if compressed) and its compression."""


async def _load(urls: list[str], indexes: list[str] | None, folder: Path) -> list[Indexed]:
    limit = asyncio.Semaphore(SCANS_AT_ONCE)
    async with storage.borrowed() as reads:

        async def load(n: int) -> Indexed:
            async with limit:
                given = None if indexes is None else indexes[n]
                return await _records(reads, urls[n], given, folder)

        return list(await asyncio.gather(*(load(n) for n in range(len(urls)))))


async def _records(reads: storage.Storage, url: str, index: str | None, folder: Path
                   ) -> Indexed:
    """A file's records: from its index (given, or beside it), a kept one, or a scan."""
    size = await reads.size(url)
    if index is None:
        try:
            text = await reads.read(url + INDEX_SUFFIX)
            index = url + INDEX_SUFFIX
        except (FetchError, OSError):
            text = None
    else:
        text = await reads.read(index)
    if text is not None and index is not None:
        return _from_index(url, index, text, size), None
    for compression in (None, *READABLE):
        kept = _kept(folder, url, size, compression)
        try:
            text = await off_loop(kept.read_bytes)
        except OSError:
            continue
        with contextlib.suppress(TFRecordError):
            end = size if compression is None else _end(text)
            return _from_index(url, str(kept), text, end), compression
    scan = Scan(reads.stream(url), url, TFRecordError)
    async with aclosing(scan.content()) as content:
        offsets, sizes = await _scan(content, url)
    compression = scan.compression
    await off_loop(keep, _kept(folder, url, size, compression),
                   "".join(f"{o} {s}\n" for o, s in zip(offsets, sizes, strict=True)))
    return _as_records(offsets, sizes), compression


def _kept(folder: Path, url: str, size: int, compression: str | None) -> Path:
    """Where a scan's index is kept: by URL and size, and the compression it was found in."""
    return kept_path(folder, f"{url}@{size}", ".idx" if compression is None
                     else f".{compression}.idx")


def _end(text: bytes) -> int:
    """Where a kept index's last record ends: a compressed file's content is that long."""
    offsets, sizes = read_index(text, "kept index")
    return offsets[-1] + sizes[-1] if offsets else 0


def _from_index(url: str, index: str, text: bytes, size: int) -> FileRecords:
    offsets, sizes = read_index(text, index)
    end = 0
    for offset, length in zip(offsets, sizes, strict=True):
        if offset < end or length < FRAMING or offset + length > size:
            raise TFRecordError(f"{index}: the record at offset {offset} ({length} bytes) does "
                                f"not fit {url} ({size} bytes) after the one before, ending "
                                f"at {end}: the index is not this file's")
        end = offset + length
    return _as_records(offsets, sizes)


def _as_records(offsets: list[int], sizes: list[int]) -> FileRecords:
    return FileRecords(offsets, [o + s for o, s in zip(offsets, sizes, strict=True)],
                       [f"@{o}" for o in offsets])


async def _scan(content: AsyncIterator[bytes], url: str) -> tuple[list[int], list[int]]:
    """Each record's offset and size, by walking the length headers (each checked by its CRC;
    the data is checked when read) of the file's content, decompressed if it was."""
    offsets: list[int] = []
    sizes: list[int] = []
    buffer, base, position = bytearray(), 0, 0
    async for chunk in content:
        buffer += chunk
        while position - base + HEADER <= len(buffer):
            at = position - base
            offsets.append(position)
            sizes.append(record_size(bytes(buffer[at : at + HEADER]), url, position))
            position += sizes[-1]
        consumed = min(position - base, len(buffer))
        del buffer[:consumed]
        base += consumed
    end = base + len(buffer)
    if position > end:
        raise TFRecordError(f"{url}: truncated record at offset {offsets[-1]}: it takes "
                            f"{sizes[-1]} bytes, the file has {end - offsets[-1]} from there")
    if position != end:
        raise TFRecordError(f"{url}: truncated record at offset {position}: "
                            f"{end - position} bytes, short of a record's header")
    return offsets, sizes


class TFRecordStream(IndexedStream):
    """The records of `.tfrecord` files (brace patterns too) read file by file, as tf.data's
    `TFRecordDataset` reads them: plain, or compressed as TensorFlow's GZIP writes them
    (bzip2 and xz too), which have no ranges to read. Each item is a record's data, checked
    by its masked CRC-32C, as `TFRecord` gives it.

    Where the records lie comes from `FILE.idx` beside a plain file, else from one scan of the
    file's (decompressed) content, kept in `index_dir` by URL and size. An epoch divides by
    records: every rank gets as many, a rank reads only its range (a compressed file from its
    first byte, up to the end of its share), and a job resumes on any world size. With the
    Loader's `shuffle=True`, the file order is shuffled per epoch and records within windows
    of `shuffle_buffer` consecutive records, as tf.data's `shuffle(buffer_size)`; memory
    holds about `files_ahead` windows.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        shuffle_buffer: int = 1000,
        files_ahead: int = 2,
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.urls = _expanded(urls)
        if not self.urls:
            raise ValueError("TFRecordStream needs at least one .tfrecord file")
        if shuffle_buffer < 0 or files_ahead < 1:
            raise ValueError("shuffle_buffer must be >= 0 and files_ahead >= 1")
        for url in self.urls:
            storage.check_url(url)
        self.window = max(1, shuffle_buffer)
        self.pieces_ahead = files_ahead
        loaded = run_sync(_load(self.urls, None, index_folder(index_dir, "tfrecord-index")))
        self._records = [records for records, _ in loaded]
        self.compressions = [compression for _, compression in loaded]
        self.unit_sizes = np.array([len(r.starts) for r in self._records], np.int64)
        if not self.unit_sizes.sum():
            raise ValueError(f"the TFRecord files hold no records: {self.urls[:3]}...")

    def read_weight(self, unit: int, count: int) -> int:
        records = self._records[unit]
        return (records.ends[-1] - records.starts[0]) * count // max(1, len(records.starts))

    async def read_samples(
        self, reads: storage.Storage, unit: int, start: int, stop: int, memo: dict[Any, Any]
    ) -> Sequence[bytes]:
        """Records start..stop of a file: one ranged read, or a compressed file's content
        from where its pass stands."""
        url, records = self.urls[unit], self._records[unit]
        first, end = records.starts[start], records.ends[stop - 1]
        async with content_range(reads, memo, unit, url, self.compressions[unit], first, end,
                                 TFRecordError) as chunks, aclosing(chunks):
            data = b"".join([chunk async for chunk in chunks])
        if len(data) != end - first:
            raise TFRecordError(f"{url}: records {start}..{stop} take bytes {first}..{end} of "
                                f"it, and it has {len(data)} from {first}: it changed since "
                                "it was indexed")
        view, found = memoryview(data), []
        for offset, record_end in zip(records.starts[start:stop], records.ends[start:stop],
                                      strict=True):
            found.append(unframe(view[offset - first : record_end - first], url, offset)[0])
        return found
