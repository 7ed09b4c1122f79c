"""When a read is tried again: what counts as a fault another try may mend (`Retryable`, which a
store raises at its boundary), and how long to wait before the next try: capped exponential
backoff with jitter. `Storage` holds the only retry loop."""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass

from .._errors import FetchError
from ._counters import StorageCounters

DEFAULT_RETRIES = 10
"""Ten retries make a 10% fault rate fail a read with odds 1e-11: an epoch of millions survives."""
DEFAULT_TIMEOUT = 30.0
MAX_RETRY_AFTER = 30.0
"""A server asking for a longer pause than this is still retried, but after this long."""


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = DEFAULT_RETRIES
    timeout: float = DEFAULT_TIMEOUT
    backoff_base: float = 0.05
    backoff_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be 0 or more, got {self.retries}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout}")

    def backoff(self, attempt: int) -> float:
        """Seconds before retry number `attempt` (0-based): half fixed, half random."""
        ceiling = min(self.backoff_cap, self.backoff_base * 2.0**attempt)
        return ceiling / 2 + random.uniform(0, ceiling / 2)


def is_retryable(status: int) -> bool:
    """Whether an HTTP status is a fault worth another try (else a final answer)."""
    return status in (408, 425, 429) or status >= 500


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped; None if absent."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


class Retryable(Exception):
    """A fault another try may mend, as a store reports it: what went wrong, the HTTP status,
    and the seconds the server asked to wait. Anything else a store raises is final."""

    def __init__(self, problem: str, status: int | None = None, delay: float | None = None
                 ) -> None:
        super().__init__(problem)
        self.problem = problem
        self.status = status
        self.delay = delay


class Attempts:
    """The retry budget of one read: counts failures in a row, waits with backoff (or as long
    as the server asked), gives up with an error that names the URL and the last status."""

    def __init__(self, url: str, policy: RetryPolicy, counters: StorageCounters) -> None:
        self._url = url
        self._policy = policy
        self._counters = counters
        self._failures = 0

    def reset(self) -> None:
        """Progress was made (a stream moved on): the budget starts again."""
        self._failures = 0

    async def failed(self, fault: Retryable) -> None:
        """Wait before the next try; FetchError once the budget is spent."""
        if self._failures >= self._policy.retries:
            attempts = self._policy.retries + 1
            raise FetchError(self._url, f"{fault.problem}; gave up after {attempts} attempts",
                             fault.status) from fault
        delay = fault.delay
        await asyncio.sleep(self._policy.backoff(self._failures) if delay is None else delay)
        self._failures += 1
        self._counters.retries += 1
