"""Faults against real servers on loopback: every sample exactly once, or a clear error."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
from segments import held

import aioloader
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT, index_of, jpeg_index, two_megabytes


def epoch(loader: aioloader.Loader) -> list[int]:
    return sorted(int(i) for batch in loader for i in batch)


@pytest.mark.parametrize(
    "faults",
    [
        {"error_rate": 0.2, "retry_after": 0.05},
        {"error_rate": 0.2},
        {"throttle_rate": 0.2},
        {"drop_rate": 0.2},
        {"stall_rate": 0.05, "stall_seconds": 30},
    ],
    ids=["503 with Retry-After", "503", "429", "reset mid-body", "stall past the timeout"],
)
def test_every_sample_exactly_once_through_faults(
    faulty_server: TestServer, faults: dict[str, float]
) -> None:
    faulty_server.set_faults(**faults)
    urls = [f"{faulty_server.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)] * 3
    with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=10,
                          concurrency=32, timeout=0.5) as loader:
        assert epoch(loader) == sorted(list(range(SAMPLE_COUNT)) * 3)
        assert loader.stats.retries + loader.stats.hedges > 0  # a stall may meet its hedge first


def test_fault_outlasting_the_budget_names_the_url(faulty_server: TestServer) -> None:
    faulty_server.set_faults(error_rate=1.0)
    urls = [f"{faulty_server.url}{i:04d}.bin" for i in range(8)]
    loader = aioloader.Loader(aioloader.Files(urls), batch_size=4, retries=2, num_workers=0)
    with pytest.raises(aioloader.LoaderError, match=r"0000\.bin.*HTTP 503.*3 attempts"):
        list(loader)


def test_server_restarted_mid_epoch(sample_dir: Path) -> None:
    first = TestServer(sample_dir, latency_ms=10)
    port, url = first.port, first.url
    urls = [f"{url}{i:04d}.bin" for i in range(SAMPLE_COUNT)] * 5
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=10,
                              concurrency=16, num_workers=0)
    restarted: list[TestServer] = []

    def restart() -> None:
        first.close()
        time.sleep(0.5)
        restarted.append(TestServer(sample_dir, port=port, latency_ms=10))

    seen = []
    try:
        for n, batch in enumerate(loader):
            seen += [int(i) for i in batch]
            if n == 5:
                threading.Thread(target=restart).start()
    finally:
        first.close()
        for server in restarted:
            server.close()
    assert sorted(seen) == sorted(list(range(SAMPLE_COUNT)) * 5)
    assert restarted and loader.stats.retries > 0


def corrupt_jpegs(folder: Path) -> list[str]:
    from PIL import Image

    good = io_jpeg(Image.new("RGB", (32, 24), (10, 200, 30)))
    files = {"good-0.jpg": good, "truncated.jpg": good[: len(good) // 2],
             "garbage.jpg": b"this is not an image" * 10, "empty.jpg": b"", "good-1.jpg": good}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return [str(folder / name) for name in files]


def io_jpeg(image: object) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="JPEG")  # type: ignore[attr-defined]
    return buffer.getvalue()


def test_corrupt_samples_raise_or_are_skipped(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    paths = corrupt_jpegs(tmp_path)
    files = aioloader.Files(paths, labels=range(len(paths)))
    with pytest.raises(aioloader.LoaderError, match=r"sample 1 .*truncated\.jpg"):
        list(aioloader.Loader(files, decode=jpeg_index, batch_size=None))
    loader = aioloader.Loader(files, decode=jpeg_index, batch_size=None, on_error="skip")
    with loader:
        assert list(loader) == [0, 4]
    assert loader.stats.skipped == 3
    assert all(any(name in r for r in loader.stats.skip_reasons)
               for name in ("truncated.jpg", "garbage.jpg", "empty.jpg"))


def shm_bytes(pid: int) -> int:
    """Bytes of the shared blocks process `pid` holds."""
    return sum(held([pid]).values())


def peak_memory_while_the_consumer_stops(
    paths: list[str], memory_limit: int | None, service: str | None
) -> float:
    """Bytes over the start: the RSS of the main process (and of its loader service) plus
    their shared blocks, at their peak while the consumer takes two batches and then stops
    for 3 s."""
    me = psutil.Process()
    loader = aioloader.Loader(aioloader.Files(paths), decode=two_megabytes, batch_size=8,
                              prefetch=1, concurrency=8, memory_limit=memory_limit,
                              service=service)
    start = me.memory_info().rss
    peak = 0
    with loader:
        for n, batch in enumerate(loader):
            del batch
            if n == 1:
                client = loader._service._client
                service = None if client is None else psutil.Process(client.pid)
                # a service is forked from the zygote: its own RSS is what it has over that
                before = 0 if service is None else psutil.Process(service.ppid()).memory_info().rss
                for _ in range(30):
                    time.sleep(0.1)
                    held = me.memory_info().rss + shm_bytes(me.pid) - start
                    if service is not None:
                        held += service.memory_info().rss + shm_bytes(service.pid) - before
                    peak = max(peak, held)
            if n == 2:
                break
    return peak


@pytest.mark.parametrize("service", [None, "process"])
def test_a_stopped_consumer_keeps_memory_within_memory_limit(
    tmp_path: Path, service: str | None
) -> None:
    """Raw samples of 960 KiB decoded to 2 MiB: read ahead without a limit, the loader would
    hold hundreds of MB while the consumer stops. (Under 1 MiB, so read in the event loop:
    larger local files are read in the decode processes, and nothing is read ahead of them.)"""
    paths = []
    for i in range(400):
        path = tmp_path / f"{i:04d}.bin"
        path.write_bytes(i.to_bytes(4, "little") + bytes(960 << 10))
        paths.append(str(path))
    limit = 64 << 20
    bounded = peak_memory_while_the_consumer_stops(paths, limit, service)
    unbounded = peak_memory_while_the_consumer_stops(paths, None, service)
    # a chunk read past the limit (8 MiB), a batch decoding (16), reads in flight (8), and the
    # allocator's hold on freed buffers (glibc keeps some in each thread's arena: up to 67 MiB
    # over the limit in all seen so far)
    overhead = 80 << 20
    if service is not None:  # a second process: its heap, allocator arenas and threads' stacks
        overhead += 40 << 20  # (37 MiB more than in one process, with or without the limit)
    assert bounded < limit + overhead, f"{bounded / 2**20:.0f} MiB held"
    assert unbounded > bounded + 2 * limit  # what the limit saves here


def test_a_pass_where_every_sample_fails_raises_with_the_count(
    faulty_server: TestServer,
) -> None:
    urls = [f"{faulty_server.url}missing-{i}.bin" for i in range(12)]
    loader = aioloader.Loader(aioloader.Files(urls), batch_size=4, num_workers=0,
                              on_error="skip")
    with pytest.raises(aioloader.LoaderError, match=r"every sample.*12 skipped.*missing-"):
        list(loader)
    assert all("\n" not in reason for reason in loader.stats.skip_reasons)


def test_a_failed_read_is_a_fetch_error_and_a_sample_error(faulty_server: TestServer) -> None:
    urls = [f"{faulty_server.url}{i:04d}.bin" for i in range(4)] + [faulty_server.url + "gone"]
    with pytest.raises(aioloader.FetchError) as caught:
        list(aioloader.Loader(aioloader.Files(urls), batch_size=5, num_workers=0))
    error = caught.value
    assert isinstance(error, aioloader.SampleError)
    assert error.index == 4 and error.key == urls[4] and error.url == urls[4]
    assert error.status == 404 and "\n" not in str(error)


def test_killed_decode_process_mid_epoch_raises_within_seconds(urls: list[str]) -> None:
    from decoders import die_on_five

    started = time.monotonic()
    with pytest.raises(aioloader.WorkerDiedError, match="SIGKILL"):
        list(aioloader.Loader(aioloader.Files(urls), decode=die_on_five, batch_size=4))
    assert time.monotonic() - started < 30  # a bound on hanging, not a speed figure
