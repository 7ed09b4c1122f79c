"""MXNet RecordIO files as a map-style dataset, local or over HTTP, split as dmlc splits them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import aclosing

import numpy as np

from .._loopthread import run_sync
from ..recordio import (
    FIRST,
    HEADER,
    MAGIC,
    MAX_LENGTH,
    MIDDLE,
    WHOLE,
    RecordIOError,
    _check_part,
    decode,
    read_index,
)
from ..storage import _storage as storage
from .records import FileRecords, Records


class RecordIO(Records):
    """The records of one or several `.rec` files; `fetch(i)` gives record i's payload.

    With `.idx` files each fetch is one ranged read, and reads of consecutive records in one
    batch are merged; without, each file is scanned once at construction. `num_parts` and
    `part_index` keep the records whose first byte lies in this part's share of all files'
    bytes, as dmlc's InputSplit does: parts of near-equal bytes, whatever the number of files.
    """

    def check_world_size(self, world_size: int) -> None:
        if self.num_parts > 1 and world_size > 1:
            raise ValueError(
                f"this RecordIO is part of {self.num_parts} already, and the Loader divides it "
                f"again among {world_size} ranks: each rank would read 1/"
                f"{self.num_parts * world_size} of the data. Give RecordIO num_parts=1 (the "
                "Loader divides by rank) or the Loader world_size=1"
            )

    def __init__(
        self,
        rec_urls: str | Sequence[str],
        idx_urls: str | Sequence[str] | None = None,
        num_parts: int = 1,
        part_index: int = 0,
    ) -> None:
        recs = _as_list(rec_urls)
        idxs = None if idx_urls is None else _as_list(idx_urls)
        if not recs:
            raise ValueError("RecordIO needs at least one .rec file")
        if idxs is not None and len(idxs) != len(recs):
            raise ValueError(
                f"got {len(idxs)} .idx files for {len(recs)} .rec files; give one each"
            )
        if not 0 <= part_index < num_parts:
            raise ValueError(f"part_index must be in 0..{num_parts - 1}, got {part_index}")
        for url in recs + (idxs or []):
            storage.check_url(url)
        self.urls = recs
        self.num_parts = num_parts
        self._set_records(run_sync(_load(recs, idxs, num_parts, part_index)))

    @staticmethod
    def unframe(data: bytes, url: str, start: int) -> bytes:
        payload, _ = decode(data, url, start)
        return payload


def _as_list(urls: str | Sequence[str]) -> list[str]:
    return [urls] if isinstance(urls, str) else list(urls)


async def _load(
    recs: list[str], idxs: list[str] | None, num_parts: int, part_index: int
) -> list[FileRecords]:
    async with storage.borrowed() as reads:
        sizes = await asyncio.gather(*(reads.size(url) for url in recs))
        first_bytes = np.cumsum([0, *sizes])
        total = int(first_bytes[-1])
        step = -(-total // num_parts)
        step += -step % 4  # dmlc aligns the split step to 4 bytes
        low, high = min(step * part_index, total), min(step * (part_index + 1), total)
        jobs = []
        for n, (url, size) in enumerate(zip(recs, sizes, strict=True)):
            local_low = max(low - int(first_bytes[n]), 0)
            local_high = min(high - int(first_bytes[n]), size)
            if local_low >= local_high:
                jobs.append(_nothing())
            elif idxs is not None:
                jobs.append(_from_index(reads, url, idxs[n], size, local_low, local_high))
            else:
                jobs.append(_by_scanning(reads, url, size, local_low, local_high))
        return list(await asyncio.gather(*jobs))


async def _nothing() -> FileRecords:
    return FileRecords()


async def _from_index(
    reads: storage.Storage, url: str, idx_url: str, size: int, low: int, high: int
) -> FileRecords:
    keys, offsets = read_index(await reads.read(idx_url), idx_url)
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    bounds = [offsets[i] for i in order] + [size]
    records = FileRecords()
    for rank, i in enumerate(order):
        if not 0 <= offsets[i] < size:
            raise RecordIOError(
                f"{idx_url}: key {keys[i]} points to offset {offsets[i]}, outside {url} "
                f"({size} bytes)"
            )
        if bounds[rank + 1] == offsets[i]:
            raise RecordIOError(
                f"{idx_url}: keys {keys[i]} and {keys[order[rank + 1]]} both point to offset "
                f"{offsets[i]} of {url}"
            )
        if low <= offsets[i] < high:
            records.starts.append(offsets[i])
            records.ends.append(bounds[rank + 1])
            records.keys.append(keys[i])
    return records


async def _by_scanning(
    reads: storage.Storage, url: str, size: int, low: int, high: int
) -> FileRecords:
    """Walk the record headers from `low`, resynchronising on the first record start when
    `low` falls inside a record; keep the records that start before `high`.

    A part whose length runs past the end of the file fails at its header, before the
    stream is read on to its end."""
    starts: list[int] = []
    position = low + -low % 4  # file offset of the next header to look at
    synced = low == 0  # a file must begin with a record; a split point may not
    inside = False  # after a first or middle part: a continuation must follow
    buffer, base = bytearray(), position
    async with aclosing(reads.stream(url, position)) as chunks:
        async for chunk in chunks:
            buffer += chunk
            while (at := position - base) + HEADER.size <= len(buffer):
                magic, lrec = HEADER.unpack_from(buffer, at)
                flag, length = lrec >> 29, lrec & MAX_LENGTH
                if not synced and not (magic == MAGIC and flag in (WHOLE, FIRST)):
                    position += 4
                    continue
                synced = True
                _check_part(url, position, magic, flag, inside)
                if flag in (WHOLE, FIRST):
                    if position >= high:
                        return _scanned(starts, position)
                    starts.append(position)
                inside = flag in (FIRST, MIDDLE)
                end = position + HEADER.size + length + -length % 4
                if end > size:
                    raise RecordIOError(
                        f"{url}: truncated record at offset {position}: its header says "
                        f"{length} bytes, the file has {max(size - position - HEADER.size, 0)} "
                        "after it"
                    )
                position = end
            consumed = min(position - base, len(buffer))
            del buffer[:consumed]
            base += consumed
    if inside:
        raise RecordIOError(
            f"{url}: truncated record at offset {starts[-1]}: the file ends at byte {size}, "
            "before its last part"
        )
    if synced and position < size:
        raise RecordIOError(
            f"{url}: truncated record at offset {position}: expected an 8-byte header, "
            f"{size - position} bytes remain"
        )
    return _scanned(starts, position)


def _scanned(starts: list[int], end: int) -> FileRecords:
    return FileRecords(starts, [*starts[1:], end], [f"@{s}" for s in starts])
