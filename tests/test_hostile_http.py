"""Servers that send more, or other, bytes than asked; and web pages that try to drive the test
server. Every server here is the project's test server, a real process on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path

import psutil
import pytest

from aioloader import FetchError
from aioloader.storage._storage import Storage
from aioloader.testing import CONTROL_HEADER, CONTROL_TOKEN_VARIABLE, TestServer

from decoders import sample_bytes

MiB = 1 << 20


def pattern(start: int, end: int) -> bytes:
    """Bytes start..end of /_hostile/endless and /_hostile/huge: byte i is i % 251."""
    return bytes(i % 251 for i in range(start, end))


class PeakMemory:
    """The largest growth of this process's RSS within the block, sampled every 5 ms."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._start = self._peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="rss-sampler")

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self._peak = max(self._peak, self._process.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return float(self._peak - self._start) / MiB

    def __enter__(self) -> PeakMemory:
        self._sampler.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._sampler.join(5)
        self._peak = max(self._peak, self._process.memory_info().rss)


async def collect(chunks: AsyncGenerator[bytes, None]) -> bytes:
    async with aclosing(chunks):
        return b"".join([chunk async for chunk in chunks])


# max_object_bytes


async def test_endless_body_stops_at_max_object_bytes_without_retry(server: TestServer) -> None:
    url = server.url + "_hostile/endless"
    before = server.stats().get("hostile_endless", 0)
    with PeakMemory() as memory:
        async with Storage(retries=3, max_object_bytes=32 * MiB) as reads:
            with pytest.raises(FetchError) as caught:
                await reads.read(url)
    assert url in str(caught.value) and str(32 * MiB) in str(caught.value)
    assert reads.counters.retries == 0 and server.stats()["hostile_endless"] == before + 1
    assert memory.growth_mb < 150  # the body never ends: only the limit bounds it


async def test_streams_are_not_capped_but_hold_one_chunk_at_a_time(server: TestServer) -> None:
    """A .rec scanned without its .idx may be 100 GB: max_object_bytes bounds whole reads,
    while a stream's memory is its chunk."""
    url = server.url + "_hostile/endless"
    read = 0
    with PeakMemory() as memory:
        async with Storage(retries=3, max_object_bytes=8 * MiB) as reads:
            chunks = reads.stream(url, chunk_size=MiB)
            async with aclosing(chunks):
                async for chunk in chunks:
                    read += len(chunk)
                    if read > 64 * MiB:
                        break
    assert read > 64 * MiB and memory.growth_mb < 48


async def test_100_gb_content_length_is_refused_before_reading(server: TestServer) -> None:
    url = server.url + "_hostile/huge"
    with PeakMemory() as memory:
        async with Storage(retries=2, timeout=3) as reads:  # the default limit: 2 GiB
            with pytest.raises(FetchError) as caught:
                await reads.read(url)
    message = str(caught.value)
    assert url in message and str(2 << 30) in message and "100000000000" in message
    assert reads.counters.retries == 0
    assert memory.growth_mb < 100


async def test_range_longer_than_max_object_bytes_is_refused(server: TestServer) -> None:
    async with Storage(max_object_bytes=MiB) as reads:
        with pytest.raises(FetchError, match=str(MiB)):
            await reads.read_range(server.url + "0001.bin", 0, 2 * MiB)
    assert reads.counters.requests == 0


# servers that ignore Range


async def test_ignored_range_reads_only_up_to_the_range_end(server: TestServer) -> None:
    """/_hostile/huge answers every Range with 200 and 100 GB: a record read must skip the
    prefix as it streams past, stop at the record's end and drop that connection."""
    start = 64 * MiB + 7
    with PeakMemory() as memory:
        async with Storage(retries=0, timeout=5) as reads:
            data = await reads.read_range(server.url + "_hostile/huge", start, start + 1000)
    assert data == pattern(start, start + 1000)
    assert reads.counters.ranges_ignored == 1
    assert memory.growth_mb < 32  # half of the 64 MiB prefix streamed past


async def test_ignored_ranges_are_counted_and_warned_about_once_per_storage(
    faulty_server: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    faulty_server.set_faults(ignore_ranges=True)
    url = faulty_server.url + "0042.bin"
    caplog.set_level(logging.WARNING, logger="aioloader")
    for _ in range(2):
        async with Storage() as reads:
            for start in (3, 40, 100):
                assert await reads.read_range(url, start, start + 30) == sample_bytes(42)[
                    start : start + 30
                ]
            assert await collect(reads.stream(url, 20, 60)) == sample_bytes(42)[20:60]
        assert reads.counters.ranges_ignored == 4
    warnings = [r for r in caplog.records if "ignores Range" in r.getMessage()]
    assert len(warnings) == 2 and faulty_server.url.rstrip("/") in warnings[0].getMessage()
    assert faulty_server.stats().get("ranges", 0) == 0


# a 206 with other bytes than asked


@pytest.mark.parametrize("how", ["read_range", "stream"])
async def test_206_with_another_content_range_is_refused_without_retry(
    faulty_server: TestServer, how: str
) -> None:
    faulty_server.set_faults(shift_ranges=1)
    url = faulty_server.url + "0042.bin"
    async with Storage(retries=3) as reads:
        with pytest.raises(FetchError) as caught:
            if how == "read_range":
                await reads.read_range(url, 10, 50)
            else:
                await collect(reads.stream(url, 10, 50))
    message = str(caught.value)
    assert url in message and "bytes 10-49" in message and "bytes 11-50/146" in message
    assert reads.counters.retries == 0


# redirects


async def test_redirect_loop_fails_at_once_naming_the_url(server: TestServer) -> None:
    url = server.url + "_hostile/loop"
    before = server.stats().get("hostile_loop", 0)
    async with Storage(retries=3) as reads:
        with pytest.raises(FetchError, match=r"_hostile/loop.*redirect"):
            await reads.read(url)
        with pytest.raises(FetchError, match=r"_hostile/loop.*redirect"):
            await reads.size(url)
    assert reads.counters.retries == 0
    assert server.stats()["hostile_loop"] - before == 2 * 10  # 10 redirects each, not retried


# Content-Encoding despite Accept-Encoding: identity


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_encoded_whole_body_is_decoded(faulty_server: TestServer, encoding: str) -> None:
    faulty_server.set_faults(content_encoding=encoding)
    async with Storage() as reads:
        for i in (0, 42, 99):
            assert await reads.read(f"{faulty_server.url}{i:04d}.bin") == sample_bytes(i)


@pytest.mark.parametrize("how", ["read_range", "stream"])
async def test_encoded_range_or_stream_is_refused(faulty_server: TestServer, how: str) -> None:
    faulty_server.set_faults(content_encoding="gzip")
    url = faulty_server.url + "0042.bin"
    async with Storage(retries=3) as reads:
        with pytest.raises(FetchError, match=r"0042\.bin.*gzip.*meaningless"):
            if how == "read_range":
                await reads.read_range(url, 10, 50)
            else:
                await collect(reads.stream(url))
    assert reads.counters.retries == 0


async def test_unknown_content_encoding_is_refused(faulty_server: TestServer) -> None:
    faulty_server.set_faults(content_encoding="br")
    async with Storage(retries=3) as reads:
        with pytest.raises(FetchError, match=r"0042\.bin.*'br'"):
            await reads.read(faulty_server.url + "0042.bin")
    assert reads.counters.retries == 0


async def test_gzip_bomb_stops_at_max_object_bytes_of_decoded_data(server: TestServer) -> None:
    url = server.url + "_hostile/bomb"  # 5 MB on the wire, 1 GiB decoded
    with PeakMemory() as memory:
        async with Storage(retries=3, max_object_bytes=64 * MiB) as reads:
            with pytest.raises(FetchError) as caught:
                await reads.read(url)
    assert url in str(caught.value) and str(64 * MiB) in str(caught.value)
    assert reads.counters.retries == 0
    assert memory.growth_mb < 250


# the test server's control endpoint


def post_control(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url + "_control", body, headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_control_refuses_a_web_page_post_without_the_token(faulty_server: TestServer) -> None:
    """A page can POST text/plain to any port without asking; it cannot know the token."""
    body = json.dumps({"error_rate": 1.0}).encode()
    status, _ = post_control(faulty_server.url, body, {"Content-Type": "text/plain"})
    assert status == 403
    status, _ = post_control(faulty_server.url, body, {"Content-Type": "application/json",
                                                   CONTROL_HEADER: "guessed"})
    assert status == 403
    status, text = post_control(faulty_server.url, body, {"Content-Type": "text/plain",
                                                      CONTROL_HEADER: faulty_server.control_token})
    assert status == 415 and "application/json" in text
    assert faulty_server.set_faults()["error_rate"] == 0.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error_rate": 1.5}', "error_rate must be a number from 0 to 1"),
        (b'{"drop_rate": -0.1}', "drop_rate must be a number from 0 to 1"),
        (b'{"latency_ms": "20"}', "latency_ms must be a number >= 0"),
        (b'{"ignore_ranges": 1}', "ignore_ranges must be true or false"),
        (b'{"retry_after": -1}', "retry_after must be a number >= 0 or null"),
        (b'{"error_rate": 0.5, "eror_rate": 0.5}', "unknown fault settings: eror_rate"),
        (b'[["error_rate", 1]]', "JSON object"),
        (b'{"error_rate": ', "Expecting value"),
    ],
)
def test_control_refuses_bad_settings_with_400_and_keeps_the_faults(
    faulty_server: TestServer, body: bytes, message: str
) -> None:
    headers = {"Content-Type": "application/json", CONTROL_HEADER: faulty_server.control_token}
    status, text = post_control(faulty_server.url, body, headers)
    assert status == 400 and message in text
    assert faulty_server.set_faults()["error_rate"] == 0.0
    with urllib.request.urlopen(faulty_server.url + "0001.bin", timeout=10) as response:
        assert response.read() == sample_bytes(1)


def test_set_faults_raises_the_servers_400(faulty_server: TestServer) -> None:
    with pytest.raises(urllib.error.HTTPError, match="400"):
        faulty_server.set_faults(throttle_rate=2)
    assert faulty_server.set_faults(throttle_rate=0.5)["throttle_rate"] == 0.5


def first_lines(process: subprocess.Popen[str], count: int) -> list[str]:
    """The first `count` lines the process prints, waiting at most 30 s for each."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for _ in range(count):
            lines.put(process.stdout.readline())

    threading.Thread(target=read, daemon=True).start()
    return [lines.get(timeout=30) for _ in range(count)]


@pytest.mark.parametrize("given", [None, "agreed-token"])
def test_serve_command_prints_its_token_or_takes_it_from_the_environment(
    sample_dir: Path, given: str | None
) -> None:
    environment = {k: v for k, v in os.environ.items() if k != CONTROL_TOKEN_VARIABLE}
    if given:
        environment[CONTROL_TOKEN_VARIABLE] = given
    process = subprocess.Popen(
        [sys.executable, "-m", "aioloader", "serve", str(sample_dir), "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=environment,
    )
    try:
        lines = first_lines(process, 1 if given else 2)
        url, token = lines[0].split()[-1], given or lines[-1].split()[-1]
        headers = {"Content-Type": "application/json", CONTROL_HEADER: token}
        status, text = post_control(url, b'{"latency_ms": 1}', headers)
        assert status == 200 and json.loads(text)["latency_ms"] == 1
        assert post_control(url, b'{"latency_ms": 1}', {**headers, CONTROL_HEADER: "x"})[0] == 403
    finally:
        process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
