"""loader.stats, the verdict, the timeline picture and `aioloader bench`."""

from __future__ import annotations

import re
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


def test_bench_gives_one_rate_and_shares_within_the_whole() -> None:
    """The report's rate is the epochs' together, on the bench's own clock (start-up
    included), and no share in the verdict passes 100%."""
    out = subprocess.run(
        [sys.executable, "-m", "aioloader", "bench", str(DATA / "golden.rec"), "--epochs", "2",
         "--num-workers", "1", "--batch-size", "4"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    epochs = [(float(rate), float(took)) for rate, took in
              re.findall(r"epoch \d+: (\d+) samples/s in ([\d.]+) s", out)]
    samples, overall = (int(n) for n in re.search(  # type: ignore[union-attr]
        r"(\d+) samples in \d+ batches, (\d+) samples/s", out).groups())
    assert len(epochs) == 2
    assert overall == pytest.approx(samples / sum(took for _, took in epochs), rel=0.1, abs=5)
    assert min(r for r, _ in epochs) - 1 <= overall <= max(r for r, _ in epochs) + 1
    assert all(int(share) <= 100 for share in re.findall(r"(\d+)%", out))


def test_the_consumers_wait_is_a_share_of_its_own_time() -> None:
    """On the consumer's clock: waits and its own steps; never more than the whole (the issue
    saw "waited 543% of the time" against the service's seconds)."""
    stats = aioloader.LoaderStats(batches=10, busy_seconds=1.0)
    stats.consumer_wait.add(0.5, 10)  # 5 s of waits in a pass the service timed at 1 s
    stats.consumer_work.add(0.001, 9)
    shares = [int(share) for share in re.findall(r"(\d+)%", stats.verdict())]
    assert shares and all(share <= 100 for share in shares)


def test_bench_reads_parquet_files_named_by_a_brace_pattern(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    for n in range(2):
        table = pyarrow.table({"id": list(range(n * 10, n * 10 + 10))})
        parquet.write_table(table, tmp_path / f"part-{n:04d}.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "aioloader", "bench", str(tmp_path / "part-{0000..0001}.parquet"),
         "--batch-size", "5", "--num-workers", "0"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "20 samples in 4 batches" in done.stdout


def test_the_verdict_says_when_batches_came_pickled_for_want_of_shared_memory() -> None:
    stats = aioloader.LoaderStats(batches=10, busy_seconds=1.0)
    stats.consumer_work.add(1.0)  # bound by the consumer
    stats.transport.update(pickled=3, no_space=3)
    assert stats.verdict().endswith(
        "; 3 of 10 batches came back pickled (slower) because shared memory had no room (the "
        "memory this job may use is spent): lower memory_limit or prefetch, or raise the "
        "job's memory limit")
