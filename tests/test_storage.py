"""Reads of whole objects and byte ranges, locally and over HTTP with injected faults."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from aioloader import FetchError, storage
from aioloader.storage._storage import Storage, check_url
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT, sample_bytes


async def test_local_path_and_file_url_reads(sample_dir: Path) -> None:
    path = sample_dir / "0003.bin"
    assert await storage.read(str(path)) == sample_bytes(3)
    assert await storage.read(path.as_uri()) == sample_bytes(3)
    assert await storage.read_range(str(path), 2, 9) == sample_bytes(3)[2:9]


async def test_missing_local_file_names_the_path(sample_dir: Path) -> None:
    with pytest.raises(FetchError, match=r"nothing-here\.bin"):
        await storage.read(str(sample_dir / "nothing-here.bin"))


async def test_http_read_and_range(server: TestServer) -> None:
    before = server.stats().get("ranges", 0)
    assert await storage.read(server.url + "0042.bin") == sample_bytes(42)
    assert await storage.read_range(server.url + "0042.bin", 10, 50) == sample_bytes(42)[10:50]
    assert server.stats()["ranges"] == before + 1


async def test_404_names_url_and_status_without_retrying(faulty_server: TestServer) -> None:
    url = faulty_server.url + "missing.bin"
    async with Storage() as reads:
        with pytest.raises(FetchError) as caught:
            await reads.read(url)
    assert caught.value.status == 404 and url in str(caught.value) and "404" in str(caught.value)
    assert faulty_server.stats()["requests"] == 1
    assert reads.counters.retries == 0


@pytest.mark.parametrize(
    "fault", [{"error_rate": 0.3}, {"throttle_rate": 0.3}, {"drop_rate": 0.3}]
)
async def test_faults_are_retried_until_every_read_succeeds(
    faulty_server: TestServer, fault: dict[str, float]
) -> None:
    faulty_server.set_faults(**fault)
    async with Storage(concurrency=16, hedge=False) as reads:  # one request per attempt
        for i in range(60):
            assert await reads.read(f"{faulty_server.url}{i:04d}.bin") == sample_bytes(i)
    counts = faulty_server.stats()
    injected = sum(counts.get(k, 0) for k in ("errors", "throttles", "drops"))
    assert injected > 0
    assert reads.counters.retries == injected


async def test_retry_budget_spent_names_url_and_status(faulty_server: TestServer) -> None:
    faulty_server.set_faults(error_rate=1.0)
    url = faulty_server.url + "0001.bin"
    async with Storage(retries=2) as reads:
        with pytest.raises(FetchError) as caught:
            await reads.read(url)
    assert url in str(caught.value) and "503" in str(caught.value)
    assert "3 attempts" in str(caught.value)
    assert faulty_server.stats()["requests"] == 3


async def test_retry_after_is_honoured(faulty_server: TestServer) -> None:
    faulty_server.set_faults(error_rate=1.0, retry_after=0.4)
    started = time.monotonic()
    async with Storage(retries=2) as reads:
        with pytest.raises(FetchError):
            await reads.read(faulty_server.url + "0001.bin")
    assert time.monotonic() - started >= 0.8  # two waits of the 0.4 s the server asked for


async def test_stalled_server_times_out_with_a_clear_error(faulty_server: TestServer) -> None:
    faulty_server.set_faults(stall_rate=1.0, stall_seconds=30)
    url = faulty_server.url + "0001.bin"
    async with Storage(retries=1, timeout=0.3) as reads:
        with pytest.raises(FetchError, match="timed out"):
            await reads.read(url)


def test_unknown_scheme_is_refused_with_advice() -> None:
    with pytest.raises(ValueError, match=r"unknown URL scheme 'ftp'.*http://"):
        check_url("ftp://example/x.bin")


async def test_max_object_bytes_admits_an_object_of_exactly_that_size(server: TestServer) -> None:
    url = server.url + "0042.bin"  # 146 bytes
    async with Storage(max_object_bytes=146) as reads:
        assert await reads.read(url) == sample_bytes(42)
    async with Storage(retries=3, max_object_bytes=145) as reads:
        with pytest.raises(FetchError, match=r"0042\.bin.*146 bytes.*max_object_bytes=145"):
            await reads.read(url)
    assert reads.counters.retries == 0


def test_max_object_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_object_bytes must be 1 or more"):
        Storage(max_object_bytes=0)


async def test_slow_reads_are_hedged_within_the_budget(faulty_server: TestServer) -> None:
    faulty_server.set_faults(latency_ms=5, stall_rate=0.02, stall_seconds=3)
    urls = [f"{faulty_server.url}{i % SAMPLE_COUNT:04d}.bin" for i in range(400)]
    slots = asyncio.Semaphore(32)

    async def read(reads: Storage, url: str) -> bytes:
        async with slots:
            return await reads.read(url)

    async with Storage(concurrency=32, timeout=60) as reads:
        got = await asyncio.gather(*(read(reads, u) for u in urls))
    assert got == [sample_bytes(i % SAMPLE_COUNT) for i in range(400)]
    counters = reads.counters
    assert counters.hedge_wins > 0  # stalled reads were answered by their hedge
    assert counters.hedges <= 0.05 * len(urls) + 8  # the budget, plus the burst
    async with Storage(concurrency=32, timeout=60, hedge=False) as plain:
        await asyncio.gather(*(read(plain, u) for u in urls[:50]))
    assert plain.counters.hedges == 0


def test_the_hedge_delay_is_numpys_percentile_of_recent_reads() -> None:
    import numpy as np

    from aioloader.storage._hedge import quantile

    rng = np.random.default_rng(0)
    for size in (1, 2, 33, 256):
        seconds = rng.exponential(0.02, size).tolist()
        for q in (0.0, 0.5, 0.97, 1.0):
            assert quantile(seconds, q) == pytest.approx(float(np.percentile(seconds, q * 100)))
