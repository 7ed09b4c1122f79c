"""WebDataset tar shards as a stream divided by samples: an index of where each sample starts
in each shard lets every rank read exactly its share, partial shards included."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import numpy as np

from .._blocking import off_loop
from .._errors import FetchError
from .._loopthread import run_sync
from .._tar import (
    BLOCK,
    MAX_MEMBER_BYTES,
    TarFormatError,
    sample_starts,
    samples,
    split_name,
    tar_members,
)
from ..storage import _storage as storage
from .compressed import Scan, content_range
from .indexed import IndexedStream
from .kept import index_folder, keep, kept_path
from .streaming import expand_braces

INDEX_SUFFIX = ".index.json"
"""A shard's index beside it: `train-000.tar.index.json`, written by `aioloader pack`."""
INDEX_FORMAT = "aioloader-tar-index"
SCANS_AT_ONCE = 8
_NOT_THIS_SHARD = ("the index does not fit the shard: remove it to have the shard indexed "
                   "by reading it, or write it again with `aioloader pack`")


class TarShards(IndexedStream):
    """Samples of WebDataset tar shards (local paths, file://, http(s)://, s3://, brace
    patterns).

    Each sample is a dict: `__key__`, `__url__` and one bytes value per file extension.

    An epoch divides by samples, not by shards: every rank gets the same number of samples (so
    DDP ranks take the same steps), `len()` is known, and a rank reads only its range, partial
    shards included. That needs an index of where each sample starts in each shard: read from
    `SHARD.index.json` beside the shard when there is one (`aioloader pack` writes it), else
    made by reading each shard once and kept in `index_dir` (default: aioloader's folder in
    the user's cache), keyed by the shard's URL and size. An index beside a shard that does
    not fit it (another size, a start where no tar header lies, samples before its first
    start) is a TarFormatError naming both; a kept one is made again.

    A compressed shard (gzip, bzip2, xz: WebDataset reads `.tar.gz`) has no ranges to read:
    its kept index counts its samples, and a rank reads it from its first byte, once per
    epoch, decompressing it up to the end of its share.

    With the Loader's `shuffle=True`, the shard order is shuffled per epoch with the seed, and
    samples are shuffled within windows of `shuffle_buffer` consecutive samples (0 or 1: not
    at all); memory holds about `shards_ahead` windows. Each file is held in memory whole: one
    whose tar header declares more than `max_member_bytes` fails with a TarFormatError before
    any of it is read.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        shuffle_buffer: int = 1000,
        shards_ahead: int = 2,
        max_member_bytes: int = MAX_MEMBER_BYTES,
        index_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        patterns = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [storage.check_url(u) for p in patterns for u in expand_braces(p)]
        if not self.urls:
            raise ValueError("TarShards needs at least one shard")
        if shuffle_buffer < 0 or shards_ahead < 1:
            raise ValueError("shuffle_buffer must be >= 0 and shards_ahead >= 1")
        if max_member_bytes < 0:
            raise ValueError(f"max_member_bytes must be >= 0, got {max_member_bytes}")
        self.window = max(1, shuffle_buffer)
        self.pieces_ahead = shards_ahead
        self.max_member_bytes = max_member_bytes
        folder = index_folder(index_dir, "tar-index")
        indexes = run_sync(_load_indexes(self.urls, folder, max_member_bytes))
        self.starts = [starts for starts, _ in indexes]
        """Where each sample of a shard starts (in the decompressed archive), then its end."""
        self.compressions = [compression for _, compression in indexes]
        if any(self.compressions):  # a compressed shard's ranges are read from its start
            self.first_apart = False
        self.unit_sizes = np.array([len(s) - 1 for s in self.starts], np.int64)
        if not self.unit_sizes.sum():
            raise ValueError(f"the tar shards hold no samples: {self.urls[:3]}...")

    first_apart = True

    def read_weight(self, unit: int, count: int) -> int:
        starts = self.starts[unit]
        return (starts[-1] - starts[0]) * count // max(1, len(starts) - 1)

    async def read_samples(
        self, reads: storage.Storage, unit: int, start: int, stop: int, memo: dict[Any, Any]
    ) -> Sequence[Any]:
        """One ranged read of the bytes of samples start..stop, parsed as they arrive."""
        url, starts = self.urls[unit], self.starts[unit]
        async with content_range(reads, memo, unit, url, self.compressions[unit], starts[start],
                                 starts[stop], TarFormatError) as chunks:
            return await self._parsed(chunks, url, starts, start, stop)

    async def _parsed(self, chunks: AsyncGenerator[bytes, None], url: str, starts: list[int],
                      start: int, stop: int) -> list[dict[str, Any]]:
        async with aclosing(chunks), aclosing(
            tar_members(chunks, url, self.max_member_bytes, base=starts[start])
        ) as members, aclosing(samples(members, url)) as grouped:
            found = [sample async for sample in grouped]
        if len(found) != stop - start:
            raise TarFormatError(
                f"{url}: bytes {starts[start]}..{starts[stop]} hold {len(found)} samples where "
                f"its index says {stop - start}: the shard changed since it was indexed "
                "(remove its index to make a new one)"
            )
        return found


Index = tuple[list[int], str | None]
"""Where each sample of a shard starts, then where its archive ends; and the shard's
compression, if any (its starts and end are then in the decompressed archive)."""


async def _load_indexes(urls: list[str], folder: Path, max_member_bytes: int) -> list[Index]:
    """Each shard's index: beside it, in the index folder, or made by reading it."""
    limit = asyncio.Semaphore(SCANS_AT_ONCE)
    async with storage.borrowed() as reads:

        async def load(url: str) -> Index:
            async with limit:
                return await _index(reads, url, folder, max_member_bytes)

        return list(await asyncio.gather(*(load(url) for url in urls)))


async def _index(
    reads: storage.Storage, url: str, folder: Path, max_member_bytes: int
) -> Index:
    """A shard's index. An index beside the shard that does not fit it is
    an error (it is the user's, shipped with the data: either may be the wrong one, and a
    scan in its place would turn every construction into a read of the shard); one kept in
    the index folder is ours, and is made again."""
    size = await reads.size(url)
    try:
        beside = await reads.read(url + INDEX_SUFFIX)
    except (FetchError, OSError):
        beside = None
    if beside is not None:
        index = _parse_index(url + INDEX_SUFFIX, beside, size)
        await _check_head(reads, url, url + INDEX_SUFFIX, index, max_member_bytes)
        return index
    kept = kept_path(folder, url)
    with contextlib.suppress(OSError, TarFormatError):
        index = _parse_index(str(kept), await off_loop(kept.read_bytes), size)
        await _check_head(reads, url, str(kept), index, max_member_bytes)
        return index
    scan = Scan(reads.stream(url), url, TarFormatError)
    async with aclosing(scan.content()) as archive, aclosing(
        tar_members(archive, url, max_member_bytes, keep_data=False)
    ) as members:
        starts = await sample_starts(members)
    end = size if scan.compression is None else scan.length
    await off_loop(keep, kept, index_document(url, starts, size, scan.compression, end))
    return [*starts, end], scan.compression


async def _check_head(
    reads: storage.Storage, url: str, where: str, index: Index, max_member_bytes: int
) -> None:
    """Refuse an index whose first start skips samples: reads start there, so a sample before
    it would never be read, and nothing else would notice. Where the first start is 0, as in
    every index that `pack` or a scan makes, nothing is read; else the bytes before it, which
    may hold only files that WebDataset passes over (`__index__`, names without an
    extension)."""
    first = index[0][0]
    if first == 0:
        return
    skipped = None
    chunks = reads.stream(url, 0, first)
    try:
        async with aclosing(chunks), aclosing(
            tar_members(chunks, url, max_member_bytes, keep_data=False)
        ) as members:
            async for name, _, start in members:
                parts = split_name(name)
                if parts is not None:
                    skipped = f"sample {parts[0]!r} at byte {start}"
                    break
    except TarFormatError as e:
        raise TarFormatError(f"{where}: its first sample starts at byte {first}, where no tar "
                             f"member starts ({e}); {_NOT_THIS_SHARD}") from None
    if skipped is not None:
        raise TarFormatError(f"{where}: its first sample starts at byte {first}, but the shard "
                             f"holds {skipped}, which would never be read; {_NOT_THIS_SHARD}")


def index_document(url: str, starts: list[int], size: int, compression: str | None = None,
                   end: int | None = None) -> str:
    """A shard's index as JSON: the size it was made for and where each sample starts; for a
    compressed shard, its compression and where its decompressed archive ends."""
    document: dict[str, Any] = {"format": INDEX_FORMAT, "version": 1, "url": url,
                                "size": size, "starts": starts}
    if compression is not None:
        document.update(compression=compression, end=end)
    return json.dumps(document)


def _parse_index(where: str, data: bytes, size: int) -> Index:
    """An index document as the index it holds, or a TarFormatError naming what does not fit
    a shard of `size` bytes."""
    try:
        document = json.loads(data)
        starts = [int(s) for s in document["starts"]]
        compression = document.get("compression")
        end = int(document["end"]) if compression is not None else size
        right = document.get("format") == INDEX_FORMAT
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TarFormatError(f"{where}: not a tar shard index ({type(e).__name__}: {e})"
                             ) from None
    if not right:
        raise TarFormatError(f"{where}: not a tar shard index (format "
                             f"{document.get('format')!r}, not {INDEX_FORMAT!r})")
    problem = _misfit(document.get("size"), starts, size, end)
    if problem is not None:
        raise TarFormatError(f"{where}: {problem}; {_NOT_THIS_SHARD}")
    return [*starts, end], compression


def _misfit(made_for: object, starts: list[int], size: int, end: int) -> str | None:
    """Why starts cannot be those of a shard of `size` bytes whose archive ends at `end`: a
    tar header lies at a multiple of 512 bytes, and a sample holds one at least."""
    if made_for != size:
        return f"it was made for a shard of {made_for} bytes, not {size}"
    for n, (start, next_start) in enumerate(itertools.pairwise([*starts, end])):
        if start < 0 or start % BLOCK:
            return f"sample {n} starts at byte {start}, where no tar header lies"
        if start + BLOCK > next_start:
            return f"sample {n} starts at byte {start}, no room for it before byte {next_start}"
    return None
