"""Finished batches on their way to the consumer: in step order, or as they finish, and the
count of steps handed over as a contiguous prefix (where a resumed pass starts)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

EMPTY = object()
"""A step whose samples were all skipped: counted as done, not delivered."""


@dataclass(frozen=True)
class Failed:
    """A step whose batch failed; raised when its turn comes, so earlier batches still go out."""

    error: BaseException


@dataclass(frozen=True)
class Finished:
    step: int
    item: Any
    """The batch (or sample), EMPTY, or Failed."""
    held: int
    """Bytes it holds, counted against the memory limit until the consumer takes it."""
    at: float


class Handover:
    def __init__(self, ordered: bool) -> None:
        self._ordered = ordered
        self._done: dict[int, Finished] = {}
        self._next = 0
        self._failure: BaseException | None = None
        self._finished = False
        self._changed = asyncio.Event()
        self._prefix = 0
        self._ahead: set[int] = set()

    def put(self, finished: Finished) -> None:
        self._done[finished.step] = finished
        self._changed.set()

    @property
    def failed(self) -> bool:
        """`fail` was called: no step comes any more."""
        return self._failure is not None

    def fail(self, error: BaseException) -> None:
        """Stop at once: the next take raises `error` (a stall, a closed loader, a dead pool)."""
        if self._failure is None:
            self._failure = error
        self._changed.set()

    def finish(self) -> None:
        """Every step has been put."""
        self._finished = True
        self._changed.set()

    @property
    def next_step(self) -> int:
        """In order: the step the consumer gets next."""
        return self._next

    @property
    def waiting(self) -> int:
        """Steps finished and not yet taken."""
        return len(self._done)

    async def take(self) -> Finished | None:
        """The next finished step, or None at the end of the pass."""
        while True:
            if self._failure is not None:
                raise self._failure
            if self._ordered and self._next in self._done:
                self._next += 1
                return self._done.pop(self._next - 1)
            if not self._ordered and self._done:
                return self._done.pop(min(self._done))
            if self._finished and not self._done:
                return None
            self._changed.clear()
            await self._changed.wait()

    def steps_done(self, step: int) -> int:
        """Record `step` as handed over; the length of the contiguous prefix of done steps."""
        self._ahead.add(step)
        while self._prefix in self._ahead:
            self._ahead.remove(self._prefix)
            self._prefix += 1
        return self._prefix
