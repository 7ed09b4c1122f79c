"""The soak run (`make soak`; not in the default run): epochs over the test server with 5% of
requests failing, for SOAK_MINUTES (30 by default), printing samples/s per minute and the peak
resident memory; every epoch must deliver every sample exactly once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

import aioloader
from aioloader.testing import TestServer

from decoders import index_of, write_samples

pytestmark = pytest.mark.soak


def test_soak_with_five_percent_faults(tmp_path: Path) -> None:
    minutes = float(os.environ.get("SOAK_MINUTES", "30"))
    count = 2000
    write_samples(tmp_path, count)
    me = psutil.Process()
    peak = 0.0
    with TestServer(tmp_path, latency_ms=20, error_rate=0.03, drop_rate=0.02) as server:
        urls = [f"{server.url}{i:04d}.bin" for i in range(count)]
        loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=64,
                                  shuffle=True, concurrency=128)
        started = time.monotonic()
        minute_started, minute_samples, epochs = started, 0, 0
        with loader:
            while time.monotonic() - started < minutes * 60:
                seen = []
                for batch in loader:
                    seen += batch.tolist()
                    minute_samples += len(batch)
                    peak = max(peak, me.memory_info().rss / 1e6)
                    if time.monotonic() - minute_started >= 60:
                        rate = minute_samples / (time.monotonic() - minute_started)
                        print(f"minute {int((time.monotonic() - started) // 60)}: "
                              f"{rate:.0f} samples/s, peak RSS {peak:.0f} MB, "
                              f"{loader.stats.retries} retries", flush=True)
                        minute_started, minute_samples = time.monotonic(), 0
                assert sorted(seen) == list(range(count))
                epochs += 1
        print(f"{epochs} epochs, {loader.stats.retries} retries, peak RSS {peak:.0f} MB")
