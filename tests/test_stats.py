"""loader.stats, the verdict, the timeline picture and `aioloader bench`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import aioloader

from decoders import index_of, slow_decode

DATA = Path(__file__).parent / "data"


def test_stage_figures_and_a_decode_bound_verdict(local_paths: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths[:40]), decode=slow_decode,
                              batch_size=4, num_workers=1)
    with loader:
        list(loader)
    stats = loader.stats
    assert stats.samples == 40 and stats.batches == 10 and stats.fetch.count == 40
    assert stats.decode.count == 40 and stats.decode.percentile(50) >= 0.015
    assert stats.verdict().startswith("bound by decode")
    assert "decode per sample" in str(stats) and "verdict: bound by decode" in str(stats)


def test_a_slow_consumer_is_the_bottleneck(local_paths: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths[:40]), decode=index_of, batch_size=4,
                              num_workers=0)
    for _ in loader:
        time.sleep(0.05)
    assert loader.stats.verdict().startswith("bound by the consumer")


def test_timeline_has_the_fetch_decode_and_consumer_rows(
    local_paths: list[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=index_of, batch_size=10)
    with loader:
        list(loader)
    rows = {event.row for event in loader.stats.events}
    assert {"fetch", "consumer"} <= rows and any(r.startswith("decode ") for r in rows)
    picture = loader.timeline(tmp_path / "timeline.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_command_prints_rates_and_the_verdict() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aioloader", "bench", str(DATA / "golden.rec"), "--epochs", "2",
         "--num-workers", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "epoch 1:" in out and "samples/s" in out and "verdict:" in out


def test_stats_travel_with_their_timeline(local_paths: list[str]) -> None:
    """A loader service sends its stats at each pass's end: the timeline goes along whole."""
    import pickle

    loader = aioloader.Loader(aioloader.Files(local_paths[:20]), decode=index_of, batch_size=4,
                              num_workers=1, service=None)
    with loader:
        list(loader)
    stats = loader.stats
    copy = pickle.loads(pickle.dumps(stats))
    assert copy.events == stats.events and len(stats.events) >= 10
    assert copy.raw_events.maxlen == stats.raw_events.maxlen
    assert copy.decode.count == stats.decode.count == 20
    decode_boxes = [e for e in stats.events if e.row.startswith("decode ")]
    assert len(decode_boxes) == 5  # one box per chunk (a batch here), not per sample
