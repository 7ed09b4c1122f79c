"""Faults against real servers on loopback: every sample exactly once, or a clear error."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest

import aioloader
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT, big_image, index_of, jpeg_index


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
        assert loader.stats.retries > 0


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


def test_slow_and_stopped_consumers_keep_memory_within_the_prefetch_bound(
    urls: list[str],
) -> None:
    batch_mb = 10 * 3 * 64 * 64 * 4 / 1e6
    loader = aioloader.Loader(aioloader.Files(urls * 4), decode=big_image, batch_size=10,
                              prefetch=2, concurrency=16)
    me = psutil.Process()
    peaks = []
    with loader:
        for n, batch in enumerate(loader):
            if n == 3:
                time.sleep(5)  # the consumer stops; the loader must not run ahead
            else:
                time.sleep(0.02)
            peaks.append(me.memory_info().rss / 1e6)
            del batch
    bound = (loader._decode_window() + loader.prefetch + 4) * batch_mb  # decoding + waiting
    assert max(peaks) - peaks[0] < bound + 20  # + 20 MB for the interpreter's own churn


def test_killed_decode_process_mid_epoch_raises_within_seconds(urls: list[str]) -> None:
    from decoders import die_on_five

    started = time.monotonic()
    with pytest.raises(aioloader.WorkerDiedError, match="SIGKILL"):
        list(aioloader.Loader(aioloader.Files(urls), decode=die_on_five, batch_size=4))
    assert time.monotonic() - started < 30  # a bound on hanging, not a speed figure
