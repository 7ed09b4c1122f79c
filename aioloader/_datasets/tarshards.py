"""WebDataset tar shards as a stream: shards read in order, a few ahead, never whole in memory."""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

import numpy as np

from .._sampling import epoch_order, get_shard_info
from .._tar import MAX_MEMBER_BYTES, samples, tar_members
from ..storage import _storage as storage
from .base import Stream

_DONE = object()
_SHARD_ORDER, _BUFFER = 3, 4


def expand_braces(pattern: str) -> list[str]:
    """`train-{000..002}.tar` -> three names (zero padding kept); `{a,b}` -> two."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", match.group(1))
    if numbers:
        first, last = numbers.groups()
        options = [f"{i:0{len(first)}d}" for i in range(int(first), int(last) + 1)]
    else:
        options = match.group(1).split(",")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [name for option in options for name in expand_braces(head + option + tail)]


class TarShards(Stream):
    """Samples of WebDataset tar shards (local paths or http(s):// URLs, brace patterns).

    Each sample is a dict: `__key__`, `__url__` and one bytes value per file extension. With
    the Loader's `shuffle=True`, shard order is shuffled per epoch with the seed and samples
    pass through a shuffle buffer of `shuffle_buffer` samples. Ranks take every
    `world_size`-th shard of the epoch's order, so no sample reaches two ranks.

    Each file is held in memory whole: one whose tar header declares more than
    `max_member_bytes` fails the shard with a TarFormatError before any of it is read.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        shuffle_buffer: int = 1000,
        shards_ahead: int = 2,
        samples_ahead: int = 64,
        max_member_bytes: int = MAX_MEMBER_BYTES,
    ) -> None:
        patterns = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [storage.check_url(u) for p in patterns for u in expand_braces(p)]
        if not self.urls:
            raise ValueError("TarShards needs at least one shard")
        if shuffle_buffer < 0 or shards_ahead < 1 or samples_ahead < 1:
            raise ValueError("shuffle_buffer must be >= 0, shards_ahead and samples_ahead >= 1")
        if max_member_bytes < 0:
            raise ValueError(f"max_member_bytes must be >= 0, got {max_member_bytes}")
        self.shuffle_buffer = shuffle_buffer
        self.shards_ahead = shards_ahead
        self.samples_ahead = samples_ahead
        self.max_member_bytes = max_member_bytes

    def shards_for_this_rank(self) -> list[str]:
        info = get_shard_info()
        order = epoch_order(len(self.urls), info.shuffle, info.seed, info.epoch, _SHARD_ORDER)
        return [self.urls[i] for i in order[info.rank :: info.world_size]]

    async def __aiter__(self) -> AsyncGenerator[dict[str, Any], None]:
        info = get_shard_info()
        items = self._read_in_order(self.shards_for_this_rank())
        if info.shuffle and self.shuffle_buffer > 1:
            sequence = np.random.SeedSequence(
                [info.seed, info.epoch], spawn_key=(_BUFFER, info.rank)
            )
            items = _shuffled(items, self.shuffle_buffer, np.random.default_rng(sequence))
        async with aclosing(items):
            async for item in items:
                yield item

    async def _read_in_order(self, urls: list[str]) -> AsyncGenerator[dict[str, Any], None]:
        """Shards in order, up to `shards_ahead` of them downloading at once."""
        pending = iter(urls)
        reading: deque[tuple[asyncio.Queue[Any], asyncio.Task[None]]] = deque()
        async with storage.borrowed() as reads:

            def start_next() -> None:
                url = next(pending, None)
                if url is not None:
                    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=self.samples_ahead)
                    task = asyncio.create_task(_fill(reads, url, queue, self.max_member_bytes))
                    reading.append((queue, task))

            try:
                for _ in range(self.shards_ahead):
                    start_next()
                while reading:
                    queue, _ = reading[0]
                    while (item := await queue.get()) is not _DONE:
                        if isinstance(item, BaseException):
                            raise item
                        yield item
                    reading.popleft()
                    start_next()
            finally:
                for _, task in reading:
                    task.cancel()
                await asyncio.gather(*(task for _, task in reading), return_exceptions=True)


async def _fill(
    reads: storage.Storage, url: str, queue: asyncio.Queue[Any], max_member_bytes: int
) -> None:
    try:
        async with aclosing(reads.stream(url)) as chunks, aclosing(
            tar_members(chunks, url, max_member_bytes)
        ) as members, aclosing(samples(members, url)) as grouped:
            async for sample in grouped:
                await queue.put(sample)
    except Exception as e:
        await queue.put(e)
    else:
        await queue.put(_DONE)


FIRST_YIELD = 100
"""Samples in the shuffle buffer before the first comes out (as WebDataset's `initial`)."""


async def _shuffled(
    items: AsyncGenerator[dict[str, Any], None], size: int, rng: np.random.Generator
) -> AsyncGenerator[dict[str, Any], None]:
    """A shuffle buffer that starts giving samples once it holds FIRST_YIELD (not `size`, which
    would delay the first batch by a whole buffer), then grows to `size` by taking two samples
    in for each it gives out."""
    buffer: list[dict[str, Any]] = []
    async with aclosing(items):
        async for item in items:
            buffer.append(item)
            if len(buffer) < min(FIRST_YIELD, size):
                continue
            if len(buffer) < size:
                extra = await anext(items, None)
                if extra is not None:
                    buffer.append(extra)
            slot = int(rng.integers(len(buffer)))
            buffer[slot], buffer[-1] = buffer[-1], buffer[slot]
            yield buffer.pop()
    rng.shuffle(buffer)
    for item in buffer:
        yield item
