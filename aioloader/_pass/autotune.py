"""concurrency="auto": a read limit that moves while the loader runs.

Every `INTERVAL` seconds the tuner looks at the last interval: if the reads used their whole
limit and the consumer was kept waiting, more reads in flight may help, so the limit grows by
half; if the last growth brought less than `MIN_GAIN` more samples/s while reads got slower,
it goes back down by a quarter and stays until the picture changes. Otherwise it holds.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from .._stats import now

START, LOWEST, HIGHEST = 16, 4, 1024
INTERVAL = 0.5
MIN_GAIN = 0.05


class ReadLimit:
    """A counting semaphore whose size can change while tasks wait on it; it also measures how
    long every slot was taken (the sign that more reads in flight might help).

    Waiters get slots by `order` (the step their samples are for), then arrival: when several
    passes share the limit (a node's ranks), the one furthest behind reads first, and one far
    ahead never queues the others' next batches behind its read-ahead."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.busy_since: float | None = None
        """When every slot last became taken; None while some are free."""
        self.full_seconds = 0.0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        """A heap by (order, arrival); a cancelled waiter stays until it comes up."""
        self._arrivals = itertools.count()

    def try_acquire(self) -> bool:
        """Take a slot if one is free, without awaiting (the common case, made cheap)."""
        if self.in_use >= self.limit:
            return False
        self._taken()
        return True

    async def acquire(self, order: int = 0) -> None:
        while self.in_use >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (order, next(self._arrivals), waiter))
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: the slot goes to the next
                raise
        self._taken()

    def _taken(self) -> None:
        self.in_use += 1
        if self.in_use >= self.limit and self.busy_since is None:
            self.busy_since = now()

    def release(self) -> None:
        if self.busy_since is not None:
            self.full_seconds += now() - self.busy_since
            self.busy_since = None
        self.in_use -= 1
        self._wake()

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self.in_use
        while free > 0 and self._waiters:
            waiter = heapq.heappop(self._waiters)[2]
            if not waiter.done():
                waiter.set_result(None)
                free -= 1

    def take_full_seconds(self) -> float:
        """Seconds every slot was taken since the last call."""
        moment = now()
        full = self.full_seconds + (moment - self.busy_since if self.busy_since else 0.0)
        self.full_seconds = 0.0
        if self.busy_since is not None:
            self.busy_since = moment
        return full


@dataclass
class _Sample:
    rate: float
    latency: float


Marks = Callable[[], tuple[int, float, float]]
"""Reads so far, seconds they took, seconds the consumer waited."""


class Tuner:
    """Moves a ReadLimit by what the pass observed; run `tune()` as a task beside it."""

    def __init__(self, limit: ReadLimit, marks: Marks, report: Callable[[int], None]) -> None:
        self._limit = limit
        self._marks_now = marks
        self._report = report
        self._before_growth: _Sample | None = None

    def _marks(self) -> tuple[int, float, float, float]:
        return (*self._marks_now(), now())

    async def tune(self) -> None:
        before = self._marks()
        self._limit.take_full_seconds()
        while True:
            await asyncio.sleep(INTERVAL)
            after = self._marks()
            reads, read_seconds, waited, seconds = (
                x - y for x, y in zip(after, before, strict=True)
            )
            before = after
            sample = _Sample(reads / seconds, read_seconds / reads if reads else 0.0)
            starved = waited > 0.2 * seconds
            saturated = self._limit.take_full_seconds() > 0.5 * seconds
            await self._step(sample, starved, saturated)

    async def _step(self, sample: _Sample, starved: bool, saturated: bool) -> None:
        limit = self._limit.limit
        grown = self._before_growth
        if grown is not None:
            self._before_growth = None
            gained = sample.rate > grown.rate * (1 + MIN_GAIN)
            slower = sample.latency > grown.latency * 1.2
            if not gained and slower:
                await self._set(max(LOWEST, int(limit * 0.75)))
                return
        if starved and saturated and limit < HIGHEST:
            self._before_growth = sample
            await self._set(min(HIGHEST, int(limit * 1.5) + 1))

    async def _set(self, limit: int) -> None:
        self._limit.resize(limit)
        self._report(limit)
