"""WebDataset tar shards as a stream divided by samples: an index of where each sample starts
in each shard lets every rank read exactly its share, partial shards included."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Sequence
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
from .indexed import IndexedStream
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
        folder = Path(index_dir) if index_dir is not None else default_index_dir()
        self.starts = run_sync(_load_indexes(self.urls, folder, max_member_bytes))
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
        chunks = reads.stream(url, starts[start], starts[stop])
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


def default_index_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "aioloader" / "tar-index"


async def _load_indexes(urls: list[str], folder: Path, max_member_bytes: int) -> list[list[int]]:
    """Each shard's sample starts and size: beside it, in the index folder, or by reading it."""
    limit = asyncio.Semaphore(SCANS_AT_ONCE)
    async with storage.borrowed() as reads:

        async def load(url: str) -> list[int]:
            async with limit:
                return await _index(reads, url, folder, max_member_bytes)

        return list(await asyncio.gather(*(load(url) for url in urls)))


async def _index(
    reads: storage.Storage, url: str, folder: Path, max_member_bytes: int
) -> list[int]:
    """A shard's sample starts and size. An index beside the shard that does not fit it is
    an error (it is the user's, shipped with the data: either may be the wrong one, and a
    scan in its place would turn every construction into a read of the shard); one kept in
    the index folder is ours, and is made again."""
    size = await reads.size(url)
    try:
        beside = await reads.read(url + INDEX_SUFFIX)
    except (FetchError, OSError):
        beside = None
    if beside is not None:
        starts = _parse_index(url + INDEX_SUFFIX, beside, size)
        await _check_head(reads, url, url + INDEX_SUFFIX, starts[0], max_member_bytes)
        return starts
    kept = folder / (hashlib.sha256(url.encode()).hexdigest()[:40] + ".json")
    with contextlib.suppress(OSError, TarFormatError):
        starts = _parse_index(str(kept), await off_loop(kept.read_bytes), size)
        await _check_head(reads, url, str(kept), starts[0], max_member_bytes)
        return starts
    chunks = reads.stream(url)
    async with aclosing(chunks), aclosing(
        tar_members(chunks, url, max_member_bytes, keep_data=False)
    ) as members:
        starts = await sample_starts(members)
    await off_loop(_keep, kept, index_document(url, starts, size))
    return [*starts, size]


async def _check_head(
    reads: storage.Storage, url: str, index: str, first: int, max_member_bytes: int
) -> None:
    """Refuse an index whose first start skips samples: reads start there, so a sample before
    it would never be read, and nothing else would notice. Where the first start is 0, as in
    every index that `pack` or a scan makes, nothing is read; else the bytes before it, which
    may hold only files that WebDataset passes over (`__index__`, names without an
    extension)."""
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
        raise TarFormatError(f"{index}: its first sample starts at byte {first}, where no tar "
                             f"member starts ({e}); {_NOT_THIS_SHARD}") from None
    if skipped is not None:
        raise TarFormatError(f"{index}: its first sample starts at byte {first}, but the shard "
                             f"holds {skipped}, which would never be read; {_NOT_THIS_SHARD}")


def _keep(path: Path, document: str) -> None:
    """Write an index into the cache folder; a read-only cache costs a scan next time."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(document)
        staged.replace(path)


def index_document(url: str, starts: list[int], size: int) -> str:
    """A shard's index as JSON: the size it was made for and where each sample starts."""
    return json.dumps({"format": INDEX_FORMAT, "version": 1, "url": url, "size": size,
                       "starts": starts})


def _parse_index(where: str, data: bytes, size: int) -> list[int]:
    """The starts of an index with the shard's size after them, or a TarFormatError naming
    what does not fit a shard of `size` bytes."""
    try:
        document = json.loads(data)
        starts = [int(s) for s in document["starts"]]
        right = document.get("format") == INDEX_FORMAT
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TarFormatError(f"{where}: not a tar shard index ({type(e).__name__}: {e})"
                             ) from None
    if not right:
        raise TarFormatError(f"{where}: not a tar shard index (format "
                             f"{document.get('format')!r}, not {INDEX_FORMAT!r})")
    problem = _misfit(document.get("size"), starts, size)
    if problem is not None:
        raise TarFormatError(f"{where}: {problem}; {_NOT_THIS_SHARD}")
    return [*starts, size]


def _misfit(made_for: object, starts: list[int], size: int) -> str | None:
    """Why starts cannot be those of a shard of `size` bytes: a tar header lies at a multiple
    of 512 bytes, and a sample holds one at least."""
    if made_for != size:
        return f"it was made for a shard of {made_for} bytes, not {size}"
    for n, (start, end) in enumerate(itertools.pairwise([*starts, size])):
        if start < 0 or start % BLOCK:
            return f"sample {n} starts at byte {start}, where no tar header lies"
        if start + BLOCK > end:
            return f"sample {n} starts at byte {start}, no room for it before byte {end}"
    return None
