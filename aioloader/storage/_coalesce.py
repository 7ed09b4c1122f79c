"""Merging ranged reads of neighbouring bytes, asked for in the same loop tick, into one."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

MAX_MERGED_BYTES = 16 << 20
"""A merged read larger than this is split: one huge read would delay its first samples."""

_Wait = tuple[int, int, "asyncio.Future[bytes]"]


class RangeCoalescer:
    """`read(url, start, end)` joins reads that touch end to start into one request.

    Each caller registers its range and waits; one tick later the registered ranges of each
    URL are sorted, neighbours merged, and every merged run read once and cut up. A loader
    gathers the reads of a batch in one tick, so a run of consecutive records costs one
    request instead of one each.
    """

    def __init__(self, read: Callable[[str, int, int], Awaitable[bytes]]) -> None:
        self._read = read
        self._waiting: dict[str, list[_Wait]] = {}
        self._runs: set[asyncio.Task[None]] = set()

    async def read(self, url: str, start: int, end: int) -> bytes:
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._flush)
        future: asyncio.Future[bytes] = loop.create_future()
        self._waiting.setdefault(url, []).append((start, end, future))
        return await future

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for url, ranges in waiting.items():
            for run in merge(sorted(ranges, key=lambda r: (r[0], r[1]))):
                task = asyncio.ensure_future(self._read_run(url, run))
                self._runs.add(task)
                task.add_done_callback(self._runs.discard)

    async def _read_run(self, url: str, run: list[_Wait]) -> None:
        first = run[0][0]
        last = max(end for _, end, _ in run)
        try:
            data = await self._read(url, first, last)
        except asyncio.CancelledError:
            for _, _, future in run:
                future.cancel()
            raise
        except Exception as e:
            for _, _, future in run:
                if not future.done():
                    future.set_exception(e)
            return
        for start, end, future in run:
            if not future.done():
                future.set_result(data[start - first : end - first])

    async def aclose(self) -> None:
        for task in self._runs:
            task.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)


def merge(ranges: list[_Wait]) -> list[list[_Wait]]:
    """Group sorted ranges into runs where each starts at or before the run's end so far."""
    runs: list[list[_Wait]] = []
    run_end = -1
    for item in ranges:
        start, end, _ = item
        if runs and start <= run_end and max(run_end, end) - runs[-1][0][0] <= MAX_MERGED_BYTES:
            runs[-1].append(item)
            run_end = max(run_end, end)
        else:
            runs.append([item])
            run_end = end
    return runs
