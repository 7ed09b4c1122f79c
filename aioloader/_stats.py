"""Where a loader's time goes: counters, per-stage latency percentiles, a verdict, a timeline.

Written by the loader's event loop thread, read by anyone; figures are approximate while a run
is going on.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .storage._counters import StorageCounters

MAX_REMEMBERED_SKIPS = 20
KEPT_VALUES = 20_000
"""Percentiles are over the most recent values of each stage."""
KEPT_EVENTS = 30_000
"""Timeline boxes kept (the most recent): enough for a picture, a few MB at most."""


class Distribution:
    """Count and total of a quantity, and percentiles of its recent values."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self._recent: deque[float] = deque(maxlen=KEPT_VALUES)

    def add(self, value: float, times: int = 1) -> None:
        """`value`, `times` over: a chunk read in one go counts as that many samples."""
        self.count += times
        self.total += value * times
        self._recent.extend(itertools.repeat(value, times))

    def extend(self, values: list[float]) -> None:
        self.count += len(values)
        self.total += sum(values)
        self._recent.extend(values)

    def percentile(self, q: float) -> float:
        return float(np.percentile(np.fromiter(self._recent, float), q)) if self._recent else 0.0

    def describe(self, unit: float = 1e3, suffix: str = "ms") -> str:
        if not self.count:
            return "none"
        p50, p90, p99 = (self.percentile(q) * unit for q in (50, 90, 99))
        return f"p50 {p50:.1f} / p90 {p90:.1f} / p99 {p99:.1f} {suffix} ({self.count})"


class Event(NamedTuple):
    row: str
    start: float
    end: float
    kind: str


@dataclass
class LoaderStats:
    """Running totals since the loader was built; `str()` gives the report and the verdict."""

    samples: int = 0
    batches: int = 0
    skipped: int = 0
    skip_reasons: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_REMEMBERED_SKIPS))
    fetch: Distribution = field(default_factory=Distribution)
    """Seconds per sample read (waiting for a read slot not included)."""
    decode: Distribution = field(default_factory=Distribution)
    """Seconds per sample in decode (and augment), measured in the decode process."""
    queue_wait: Distribution = field(default_factory=Distribution)
    """Seconds a finished batch waited in the prefetch queue for the consumer."""
    consumer_wait: Distribution = field(default_factory=Distribution)
    """Seconds the consumer waited for a batch."""
    consumer_work: Distribution = field(default_factory=Distribution)
    """Seconds the consumer spent between a batch and its next ask (its own step): with its
    waits, the consumer's whole time, on its own clock."""
    concurrency: int = 0
    """Reads allowed in flight (chosen by the loader when concurrency="auto")."""
    stream: bool = False
    """The source is a stream, pulled one item at a time: `concurrency` does not apply to it."""
    load_threads: int = 0
    """Threads per decode process running the dataset's loads (`from_torch`'s `__getitem__`,
    large local files' reads); 0 when the items are read in the event loop."""
    read_in_decode: bool = False
    """Local files read in the decode processes, where they are decoded, not in the event loop
    (large ones: `Files.for_local_decode`; every record of local RecordIO and TFRecord files:
    `Records.for_local_decode`); `fetch` and the storage's figures then leave them out, and
    `decode` counts their reads."""
    memory_wait: float = 0.0
    """Seconds reading or decoding (either) waited for room under `memory_limit` (batches
    held, in shared memory, in the queue or by the consumer, count against it)."""
    bytes_to_decode: int = 0
    """Bytes of the chunks' messages, as the decode processes received them through their
    channels (raw items that are bytes travel in them)."""
    shared_bytes: int = 0
    """Bytes of samples read from the socket into shared memory, which the decode processes
    take them from, rather than sent through their channel (large remote objects:
    `Files.for_local_decode`)."""
    decode_processes: int = 0
    busy_seconds: float = 0.0
    """Wall seconds spent inside runs (from first request to end or break)."""
    transport: dict[str, int] = field(default_factory=lambda: {"shared": 0, "pickled": 0})
    """Batches handed back through shared memory and through pickles (and `no_space`: how
    many of those pickles were because shared memory had no room)."""
    worker_restarts: int = 0
    """Decode processes that died (a signal, the OOM killer) and were replaced mid-pass."""
    decode_timeouts: int = 0
    """Decode tasks killed at `decode_timeout`."""
    cache_reports: list[Callable[[], dict[str, float]]] = field(default_factory=list)
    """The caches' own reports, read when `cache` is asked for."""
    source_shares: Callable[[], dict[str, float]] | None = None
    """A mixture's own count of what it drew from each source, read by `sources`."""
    raw_events: deque[tuple[str, float, float, str]] = field(
        default_factory=lambda: deque(maxlen=KEPT_EVENTS), repr=False)
    """The timeline as plain tuples: cheaper to make per sample, and to pickle (a loader
    service sends its stats at each pass's end: 30,000 named tuples took 40 ms, plain 7)."""
    storage: StorageCounters = field(default_factory=StorageCounters)
    """The storage's own counters, shared by every pass's storage; read, never written here."""

    @property
    def cache(self) -> dict[str, float]:
        """Size, fill and hits of the shared-memory cache and the disk cache, if used."""
        merged: dict[str, float] = {}
        for report in self.cache_reports:
            merged.update(report())
        return merged

    @property
    def sources(self) -> dict[str, float]:
        """With an `aioloader.Mix`: the share of samples drawn from each source."""
        return {} if self.source_shares is None else self.source_shares()

    @property
    def requests(self) -> int:
        return self.storage.requests

    @property
    def retries(self) -> int:
        return self.storage.retries

    @property
    def bytes_read(self) -> int:
        return self.storage.bytes_read

    @property
    def hedges(self) -> int:
        """Second requests sent for slow reads; `storage.hedge_wins` of them answered first."""
        return self.storage.hedges

    def record_skip(self, reason: str) -> None:
        self.skipped += 1
        self.skip_reasons.append(reason)

    @property
    def events(self) -> list[Event]:
        """The most recent timeline boxes, oldest first."""
        return list(itertools.starmap(Event, self.raw_events))

    def event(self, row: str, start: float, end: float, kind: str) -> None:
        self.raw_events.append((row, start, end, kind))

    def verdict(self) -> str:
        """Which stage bounds the loader, and the knob to turn; and batches that came back
        pickled because shared memory was short."""
        if not self.batches or self.busy_seconds <= 0:
            return "no batches yet"
        short = self.transport.get("no_space", 0)
        return self._bound() + (
            f"; {short} of {self.batches} batches came back pickled (slower) because shared "
            "memory had no room (the memory this job may use is spent): lower memory_limit or "
            "prefetch, or raise the job's memory limit" if short else "")

    def _bound(self) -> str:
        spent = self.consumer_wait.total + self.consumer_work.total
        waited = self.consumer_wait.total / spent if spent > 0 else 1.0
        if waited < 0.1:
            return (
                f"bound by the consumer: it waited for data {waited:.0%} of the time; the loader "
                "keeps up (prefetch absorbs the jitter)"
            )
        held_back = self.memory_wait / self.busy_seconds
        if held_back > 0.5:
            return (
                f"bound by memory_limit: reading or decoding waited for room "
                f"{min(held_back, 1):.0%} of the time, and the consumer for data {waited:.0%}; "
                "batches held (decoded, queued, or kept by the consumer) count against it: "
                "raise memory_limit, or keep fewer batches"
            )
        workers = max(self.decode_processes, 1)
        # with loads in the decode processes, each runs load_threads samples at once
        decode_share = self.decode.total / (self.busy_seconds * workers * max(self.load_threads, 1))
        if decode_share > 0.7 and self.read_in_decode:
            return (
                f"bound by the decode processes, which read each local file and decode it: a "
                f"sample took {self.decode.percentile(50) * 1e3:.1f} ms (p50) and kept the "
                f"{workers} process(es) {min(decode_share, 1):.0%} busy; raise num_workers"
            )
        if decode_share > 0.7 and self.load_threads:
            return (
                f"bound by the loads in the decode processes: __getitem__ took "
                f"{self.decode.percentile(50) * 1e3:.1f} ms (p50) and kept the {workers} "
                f"process(es) x {self.load_threads} io_threads {min(decode_share, 1):.0%} busy; "
                "raise io_threads when __getitem__ waits on reads, num_workers when it computes"
            )
        if decode_share > 0.7:
            return (
                f"bound by decode: the {workers} decode process(es) were busy "
                f"{min(decode_share, 1):.0%} of the time; raise num_workers, or cache decoded "
                "samples with SharedCache"
            )
        in_flight = self.fetch.total / self.busy_seconds  # reads in flight on average
        reads_share = in_flight / max(self.concurrency, 1)
        if self.stream and reads_share > 0.5:
            return (
                f"bound by the stream: the loader waited for its next item "
                f"{min(reads_share, 1):.0%} of the time; a stream is pulled one item at a time, "
                "so concurrency does not help: the stream's own read-ahead is the limit "
                "(TarShards' shards_ahead, Parquet's row_groups_ahead; larger items)"
            )
        if reads_share > 0.5:
            return (
                f"bound by storage: reads take {self.fetch.percentile(50) * 1e3:.1f} ms (p50) and "
                f"kept the {self.concurrency} read slot(s) {min(reads_share, 1):.0%} busy while "
                f"decode was busy only {decode_share:.0%}; raise concurrency"
            )
        if in_flight >= 1:
            return (
                f"bound by storage: reads take {self.fetch.percentile(50) * 1e3:.1f} ms (p50) "
                f"with only {in_flight:.1f} of {self.concurrency} read slots in use on average: "
                "each read is slow whatever the number in flight (a slow disk, or a slow or "
                "saturated server), so more concurrency will not help; read from faster or "
                "nearer storage, cache (cache_dir), or read fewer, larger objects"
            )
        return (
            f"bound by the event loop's own work: reads kept their slots {reads_share:.0%} "
            f"busy and decode {decode_share:.0%}, yet the consumer waited {waited:.0%} of the "
            "time; per-sample work in the loop (a fetch per sample, parsing a stream) is the "
            "limit: read in batches (fetch_many), move work into decode, or use larger batches"
        )

    def __str__(self) -> str:
        return self.report()

    def _shared_note(self) -> str:
        if not self.shared_bytes:
            return ""
        return (f"; {self.shared_bytes / 1e6:.1f} MB read into shared memory for decode, "
                f"{self.bytes_to_decode / 1e6:.1f} MB sent to it")

    def report(self, seconds: float | None = None) -> str:
        """The figures and the verdict; the rate over `seconds` (a caller's own clock, start-up
        included), else over the seconds the passes ran."""
        seconds = max(self.busy_seconds if seconds is None else seconds, 1e-9)
        lines = [
            f"{self.samples} samples in {self.batches} batches, {self.samples / seconds:.0f} "
            f"samples/s; {self.bytes_read / 1e6:.1f} MB in {self.requests} requests, "
            f"{self.retries} retries, {self.skipped} skipped",
            f"fetch per sample:      {self.fetch.describe()}{self._shared_note()}"
            if not self.read_in_decode else
            "fetch per sample:      none here: local files are read in the decode processes",
            f"decode per sample:     {self.decode.describe()}",
            f"batch waits in queue:  {self.queue_wait.describe()}",
            f"consumer waits:        {self.consumer_wait.describe()}",
            f"batches via shared memory / pickled: {self.transport['shared']} / "
            f"{self.transport['pickled']}",
        ]
        if self.cache:
            lines.append("cache: " + ", ".join(f"{k} {v:g}" for k, v in self.cache.items()))
        lines.append(f"verdict: {self.verdict()}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Fixed:
    """A report read once: what a snapshot of the stats carries instead of a live one."""

    value: dict[str, float]

    def __call__(self) -> dict[str, float]:
        return self.value


def snapshot(stats: LoaderStats) -> LoaderStats:
    """A copy that can be pickled and sent (by a loader service): the live reports of the
    caches and of a mixture replaced by what they say now."""
    frozen = copy.copy(stats)
    frozen.cache_reports = [Fixed(stats.cache)] if stats.cache_reports else []
    frozen.source_shares = None if stats.source_shares is None else Fixed(stats.sources)
    return frozen


def now() -> float:
    """The clock every process's timings use (system-wide monotonic on Linux)."""
    return time.monotonic()
