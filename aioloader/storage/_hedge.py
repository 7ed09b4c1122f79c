"""Hedged reads: when a read has waited longer than recent reads usually take, ask again for the
same bytes and take whichever answer comes first (Dean and Barroso, "The Tail at Scale").

The wait before the second request is a high percentile (p97) of recent read times, never
below a floor, so only reads in the slow tail are hedged; a token budget keeps the extra
requests under a share (5%) of all reads, so a store that slows down as a whole is not asked
twice for everything. The percentile sits under the budget on purpose: 3% of reads pass it
in the normal course, which leaves tokens for a genuinely slow tail (at p95, ordinary reads
just past the mark took every token and a stalled read could wait its full second). One slow
read in a hundred then costs about a hedge delay, not seconds.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ._counters import StorageCounters

PERCENTILE = 97.0
FLOOR_SECONDS = 0.005
BUDGET = 0.05
"""Extra requests per read, at most, over time."""
BURST = 8.0
"""Hedges that may go out at once after a quiet spell."""
KEPT = 256
"""Recent reads the percentile is taken over: enough for a p95, short enough to forget the
queueing burst when a pass starts all its reads at once."""
MIN_OBSERVED = 32
"""Reads to see before the percentile is used: the percentile of fewer says little."""
FIRST_DELAY = 0.25
"""The hedge delay until then: a fresh loader's first reads are hedged only if they are very
slow."""
RECOMPUTE_EVERY = 16
MAX_ATTEMPTS = 3
"""Requests for one read at once: a hedge may land in the slow tail too."""
PATIENCE = 4
"""Hedge delays after which a read may hedge on credit when no token is left: at the end of
an epoch no new reads bring tokens, and its last slow read would wait its full time."""
DEBT = 8.0
"""Tokens that may be borrowed that way; later reads pay them back, so the budget holds."""

HEDGE_MAX_BYTES = 8 << 20
"""Ranged reads larger than this are not hedged: their time is bandwidth, not a slow answer,
and a second copy (a Parquet row group, say) would cost as much again."""
HEDGE_CONNECTIONS = 32
"""Connections a storage keeps beyond its reads in flight, for their hedges."""

T = TypeVar("T")


def quantile(values: Iterable[float], q: float) -> float:
    """numpy's default (linear) percentile, q in 0..1, without numpy's fixed cost: a few
    hundred values sorted in Python cost a fraction of `np.percentile` on them."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def _done_within(task: asyncio.Future[Any], seconds: float) -> bool:
    """Wait until `task` is done or `seconds` pass, whichever is first; whether it is done.
    One future and one timer: the per-read cost of a read that needs no hedge."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    wake = functools.partial(_wake, waiter)
    task.add_done_callback(wake)
    timer = loop.call_later(seconds, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        task.remove_done_callback(wake)
    return task.done()


def _wake(waiter: asyncio.Future[None], *_: Any) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Hedger:
    def __init__(self, counters: StorageCounters, budget: float = BUDGET) -> None:
        self._counters = counters
        self._budget = budget
        self._tokens = BURST
        self._seconds: deque[float] = deque(maxlen=KEPT)
        self._unseen = 0
        self.delay = FIRST_DELAY
        """Seconds a read may take before it is hedged."""

    def _observe(self, seconds: float) -> None:
        self._seconds.append(seconds)
        self._unseen += 1
        if len(self._seconds) >= MIN_OBSERVED and self._unseen >= RECOMPUTE_EVERY:
            self._unseen = 0
            self.delay = max(FLOOR_SECONDS, quantile(self._seconds, PERCENTILE / 100))

    def _may_hedge(self, waited: float) -> bool:
        """A token is there, or the read has waited so long that it may borrow one."""
        if self._tokens >= 1:
            return True
        return waited >= PATIENCE * self.delay and self._tokens - 1 >= -DEBT

    async def read(self, attempt: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """`attempt()` (a complete read with its retries), hedged by another each time a
        hedge delay passes without an answer, while the budget allows (at most
        `MAX_ATTEMPTS` in all). The first success wins; it fails only if all fail."""
        self._tokens = min(BURST, self._tokens + self._budget)
        started = time.monotonic()
        first = asyncio.ensure_future(attempt())
        running, launched = {first}, 1
        error: BaseException | None = None
        try:
            if await _done_within(first, self.delay):  # most reads: no hedge, no asyncio.wait
                running = set()
                data = first.result()  # its error, if it failed: no hedge for a failure
                self._observe(time.monotonic() - started)
                return data
            while running:
                hedging = launched < MAX_ATTEMPTS
                done, running = await asyncio.wait(
                    running, timeout=self.delay if hedging else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    if task.exception() is None:
                        if task is not first:
                            self._counters.hedge_wins += 1
                        self._observe(time.monotonic() - started)
                        return task.result()
                    error = error or task.exception()
                if not done and self._may_hedge(time.monotonic() - started):
                    self._tokens -= 1
                    self._counters.hedges += 1
                    running.add(asyncio.ensure_future(attempt()))
                    launched += 1
            assert error is not None
            raise error
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
