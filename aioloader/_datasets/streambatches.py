"""Streams for sequential models: batch position j continues its own stream batch after batch."""

from __future__ import annotations

import asyncio
import bisect
import functools
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import numpy as np

from .._loopthread import run_sync
from .._sampling import ShardInfo, epoch_order, get_shard_info
from ..storage import _storage as storage
from .base import Stream, digest
from .streaming import expand_braces, ordered_ahead

_FILE_ORDER = 5


class StreamBatches(Stream):
    """For truncated backprop through time and other stateful sequence models.

    The files (in an order shuffled per epoch with the seed when the Loader shuffles) are read
    as one byte sequence and cut into `batch_size * world_size` equal segments; rank r's
    position j reads segment `r * batch_size + j` from start to end, `chunk_bytes` per batch.
    So position j of batch k+1 continues where position j of batch k stopped, positions never
    share data, and a position whose file runs out continues into the next file. The reads of a
    batch's positions go out together, `steps_ahead` batches in advance. Every batch is full:
    the tail shorter than a chunk at the end of each segment is left out.

    Items are the chunk's bytes; use with `Loader(stream, batch_size=<the same>)`.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        batch_size: int,
        chunk_bytes: int,
        steps_ahead: int = 4,
    ) -> None:
        patterns = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [storage.check_url(u) for p in patterns for u in expand_braces(p)]
        if not self.urls or batch_size < 1 or chunk_bytes < 1 or steps_ahead < 1:
            raise ValueError("StreamBatches needs files, and batch_size, chunk_bytes and "
                             "steps_ahead of at least 1")
        self.batch_size = batch_size
        self.chunk_bytes = chunk_bytes
        self.steps_ahead = steps_ahead
        self.sizes = run_sync(_sizes(self.urls))

    def check_batching(self, batch_size: int | None, ordered: bool) -> None:
        if batch_size != self.batch_size or not ordered:
            raise ValueError(
                f"StreamBatches(batch_size={self.batch_size}) needs "
                f"Loader(batch_size={self.batch_size}, ordered=True), got "
                f"batch_size={batch_size}, ordered={ordered}"
            )

    def steps(self, info: ShardInfo) -> int:
        """Batches per epoch (the same on every rank)."""
        segment = sum(self.sizes) // (self.batch_size * info.world_size)
        return segment // self.chunk_bytes

    def __len__(self) -> int:
        """Items this rank reads in an epoch."""
        return self.steps(get_shard_info()) * self.batch_size

    def fingerprint(self) -> dict[str, Any]:
        """Files, bytes and a digest of the files' sizes: where each segment lies depends on
        them."""
        return {"files": len(self.sizes), "bytes": sum(self.sizes),
                "sizes": digest(np.array(self.sizes, np.int64))}

    def key(self, item: Any, position: int) -> str:
        step, j = divmod(position, self.batch_size)
        return f"stream {j}, batch {step}"

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        async for item in self.iter_from(0):
            yield item

    async def iter_from(self, position: int) -> AsyncGenerator[bytes, None]:
        """Jumps straight to the batch that holds item `position`."""
        info = get_shard_info()
        order = epoch_order(len(self.urls), info.shuffle, info.seed, info.epoch, _FILE_ORDER)
        files = [(self.urls[i], self.sizes[i]) for i in order]
        segment = sum(self.sizes) // (self.batch_size * info.world_size)
        first_stream = info.rank * self.batch_size
        steps = range(position // self.batch_size, self.steps(info))
        async with storage.borrowed() as reads:

            async def read_step(step: int) -> list[bytes]:
                starts = [
                    (first_stream + j) * segment + step * self.chunk_bytes
                    for j in range(self.batch_size)
                ]
                return list(await asyncio.gather(
                    *(_read_across(reads, files, s, s + self.chunk_bytes) for s in starts)
                ))

            jobs = ((functools.partial(read_step, step), 0) for step in steps)
            async with aclosing(ordered_ahead(jobs, self.steps_ahead - 1)) as batches:
                async for chunks in batches:
                    for chunk in chunks:
                        yield chunk


async def _sizes(urls: list[str]) -> list[int]:
    async with storage.borrowed() as reads:
        return list(await asyncio.gather(*(reads.size(u) for u in urls)))


async def _read_across(
    reads: storage.Storage, files: list[tuple[str, int]], start: int, end: int
) -> bytes:
    """Bytes start..end of the files taken end to end."""
    firsts = np.cumsum([0] + [size for _, size in files]).tolist()
    pieces = []
    n = bisect.bisect_right(firsts, start) - 1
    while start < end:
        url, size = files[n]
        stop = min(end, firsts[n] + size)
        if stop > start:
            pieces.append(reads.read_range(url, start - firsts[n], stop - firsts[n]))
        start = max(start, stop)
        n += 1
    return b"".join(await asyncio.gather(*pieces))
