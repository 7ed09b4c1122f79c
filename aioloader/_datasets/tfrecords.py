"""TFRecord files as a map-style dataset, from every store: a ranged read per record with
neighbours merged, by an index beside each file or made by one scan and kept."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from contextlib import aclosing
from pathlib import Path

from .._blocking import off_loop
from .._errors import FetchError
from .._loopthread import run_sync
from .._tar import compression_of
from ..storage import _storage as storage
from ..tfrecord import FRAMING, HEADER, TFRecordError, read_index, record_size, unframe
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
    GZIP-compressed files have no ranges to read: they are refused, naming the file.
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
        self._set_records(run_sync(_load(self.urls, indexes, folder)))

    def unframe(self, data: bytes, url: str, start: int) -> bytes:
        payload, size = unframe(data, url, start)
        if size != len(data):
            raise TFRecordError(f"{url}: the record at offset {start} takes {size} bytes where "
                                f"its index says {len(data)}: the index does not fit the file")
        return payload


def _expanded(urls: str | Sequence[str]) -> list[str]:
    return [url for pattern in ([urls] if isinstance(urls, str) else urls)
            for url in expand_braces(pattern)]


async def _load(urls: list[str], indexes: list[str] | None, folder: Path) -> list[FileRecords]:
    limit = asyncio.Semaphore(SCANS_AT_ONCE)
    async with storage.borrowed() as reads:

        async def load(n: int) -> FileRecords:
            async with limit:
                given = None if indexes is None else indexes[n]
                return await _records(reads, urls[n], given, folder)

        return list(await asyncio.gather(*(load(n) for n in range(len(urls)))))


async def _records(reads: storage.Storage, url: str, index: str | None, folder: Path
                   ) -> FileRecords:
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
        return _from_index(url, index, text, size)
    kept = kept_path(folder, f"{url}@{size}", ".idx")
    try:
        return _from_index(url, str(kept), await off_loop(kept.read_bytes), size)
    except (OSError, TFRecordError):
        pass
    offsets, sizes = await _scan(reads, url, size)
    await off_loop(keep, kept, "".join(f"{o} {s}\n" for o, s in zip(offsets, sizes,
                                                                   strict=True)))
    return _as_records(offsets, sizes)


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


async def _scan(reads: storage.Storage, url: str, size: int) -> tuple[list[int], list[int]]:
    """Each record's offset and size, by walking the file's length headers (each checked by
    its CRC; the data is checked when read)."""
    offsets: list[int] = []
    sizes: list[int] = []
    buffer, base, position = bytearray(), 0, 0
    async with aclosing(reads.stream(url)) as chunks:
        async for chunk in chunks:
            if not offsets and not buffer and compression_of(chunk) == "gzip":
                raise TFRecordError(f"{url}: a GZIP-compressed TFRecord file has no records "
                                    "to read by range; decompress it (or write it with "
                                    "`aioloader pack --format tfrecord`)")
            buffer += chunk
            while position - base + HEADER <= len(buffer):
                at = position - base
                record = record_size(bytes(buffer[at : at + HEADER]), url, position)
                if position + record > size:
                    raise TFRecordError(f"{url}: truncated record at offset {position}: it "
                                        f"takes {record} bytes, the file has "
                                        f"{size - position} from there")
                offsets.append(position)
                sizes.append(record)
                position += record
            consumed = min(position - base, len(buffer))
            del buffer[:consumed]
            base += consumed
    if position != size:
        raise TFRecordError(f"{url}: truncated record at offset {position}: "
                            f"{size - position} bytes, short of a record's header")
    return offsets, sizes
