"""Counters of what a loader did, kept by the event loop thread and read by anyone."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_REMEMBERED_SKIPS = 20


@dataclass
class LoaderStats:
    """Running totals since the loader was built; `str()` gives a one-paragraph report."""

    samples: int = 0
    batches: int = 0
    bytes_read: int = 0
    requests: int = 0
    retries: int = 0
    skipped: int = 0
    skip_reasons: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_REMEMBERED_SKIPS))

    def record_skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reasons.append(reason)

    def __str__(self) -> str:
        return (
            f"{self.samples} samples in {self.batches} batches, {self.bytes_read / 1e6:.1f} MB "
            f"in {self.requests} requests, {self.retries} retries, {self.skipped} skipped"
        )
