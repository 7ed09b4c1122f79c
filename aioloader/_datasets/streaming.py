"""What the stream datasets share: brace patterns of file names, and reads kept a few ahead
of the consumer, in order."""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import TypeVar

from .._sampling import ReadRoom

T = TypeVar("T")


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


async def ordered_ahead(
    jobs: Iterable[tuple[Callable[[], Awaitable[T]], int]],
    ahead: int,
    max_bytes: int | None = None,
    room: ReadRoom | None = None,
) -> AsyncGenerator[T, None]:
    """The results of `jobs` (each a coroutine function and the bytes its result will hold),
    in order: while one result is awaited or used, up to `ahead` more are read, as long as
    all of them hold at most `max_bytes` and each fits in the memory limit's `room` (one
    always may, when nothing else is held). `room` counts a result from its start until it
    is handed over. Closing the generator cancels what is running."""
    pending = iter(jobs)
    running: deque[tuple[asyncio.Future[T], int]] = deque()
    held = 0
    upcoming = next(pending, None)

    def start(limit: int) -> None:
        nonlocal held, upcoming
        while upcoming is not None and len(running) < limit and (held == 0 or (
                (max_bytes is None or held + upcoming[1] <= max_bytes)
                and (room is None or room.fits(upcoming[1])))):
            job, weight = upcoming
            running.append((asyncio.ensure_future(job()), weight))
            held += weight
            if room is not None:
                room.hold(weight)
            upcoming = next(pending, None)

    try:
        while True:
            start(ahead + 1)
            if not running:
                return
            future, weight = running.popleft()
            try:
                result = await future
            finally:
                if room is not None:
                    room.let_go(weight)  # handed over: its items count where they go
            yield result
            del result
            held -= weight
    finally:
        for future, _ in running:
            future.cancel()
        if room is not None:
            room.let_go(sum(weight for _, weight in running))
        await asyncio.gather(*(future for future, _ in running), return_exceptions=True)
