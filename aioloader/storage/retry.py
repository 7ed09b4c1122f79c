"""How long to wait before trying a read again: capped exponential backoff with jitter."""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

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
