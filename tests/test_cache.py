"""SharedCache: decoded samples cached once, shared by the decode processes, capped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from segments import blocks

import aioloader
from aioloader._ipc import shm
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT, index_of

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm (Linux)")


def decode_once(raw: bytes) -> tuple[np.ndarray, int]:
    index = index_of(raw)
    return ((np.arange(256).reshape(16, 16) + index) % 256).astype(np.uint8), index


def flip(value: tuple[np.ndarray, int], rng: np.random.Generator) -> dict[str, object]:
    image, index = value
    return {"image": image[:, ::-1] if rng.random() < 0.5 else image, "index": index}


def segments() -> set[int]:
    """An unnamed cache's blocks, in this process (held or mapped)."""
    return set(blocks([os.getpid()]))


Batches = list[list[tuple[list[int], list[list[int]]]]]


def run_epochs(
    urls: list[str], cache: aioloader.SharedCache | None, epochs: int = 2
) -> tuple[Batches, dict[str, float]]:
    loader = aioloader.Loader(aioloader.Files(urls), decode=decode_once, augment=flip,
                              cache=cache, batch_size=10, shuffle=True, num_workers=2,
                              hedge=False)  # the test counts the server's requests
    out: Batches = []
    with loader:
        for _ in range(epochs):
            out.append([(b["index"].tolist(), b["image"][:, 0, :4].tolist()) for b in loader])
        stats = dict(loader.stats.cache)
    return out, stats


def test_cached_epochs_give_the_same_batches_and_skip_the_reads(
    server: TestServer, urls: list[str]
) -> None:
    reference, _ = run_epochs(urls, None)
    with aioloader.SharedCache(0.01) as cache:
        before = server.stats()["requests"]
        got, stats = run_epochs(urls, cache)
        assert server.stats()["requests"] - before == SAMPLE_COUNT  # epoch 2 read nothing
        assert stats["samples"] == SAMPLE_COUNT and stats["hit_rate"] == 0.5
    assert got == reference


def test_local_files_read_a_chunk_at_a_time_are_served_from_the_cache_too(
    local_paths: list[str]
) -> None:
    """Local files are read a chunk per call (`fetch_many`): the samples the cache holds are
    left out of the call, as they are of per-sample reads."""
    reference, _ = run_epochs(local_paths, None)
    with aioloader.SharedCache(0.01) as cache:
        got, stats = run_epochs(local_paths, cache)
        assert stats["samples"] == SAMPLE_COUNT and stats["hit_rate"] == 0.5
    assert got == reference


def test_samples_beyond_the_limit_are_not_cached(urls: list[str]) -> None:
    per_sample = 16 * 16 + 200
    with aioloader.SharedCache(30 * per_sample / 2**30) as cache:
        _, stats = run_epochs(urls, cache)
        assert 0 < stats["samples"] < SAMPLE_COUNT and stats["full"] == 1
        assert stats["fill"] <= 1.0


def test_cached_values_are_read_only_and_segments_go_with_close(urls: list[str]) -> None:
    before = segments()
    cache = aioloader.SharedCache(0.01)
    cache.attach(10)
    assert len(segments() - before) == 2
    assert cache.put(3, (np.arange(5), "label")) and not cache.put(3, (np.arange(2), "x"))
    array, label = cache.get(3)
    assert label == "label" and array.tolist() == [0, 1, 2, 3, 4] and not array.flags.writeable
    assert 3 in cache and 4 not in cache
    del array
    cache.close()
    assert segments() == before


def test_random_decode_with_a_cache_is_refused(urls: list[str]) -> None:
    def random_decode(raw: bytes, rng: np.random.Generator) -> bytes:
        return raw

    with aioloader.SharedCache(0.01) as cache, pytest.raises(ValueError, match="augment="):
        aioloader.Loader(aioloader.Files(urls), decode=random_decode, cache=cache, num_workers=0)


def test_disk_cache_serves_epoch_two_and_evicts_the_oldest_within_its_limit(
    faulty_server: TestServer, tmp_path: Path, sample_dir: Path
) -> None:
    urls = [f"{faulty_server.url}{i:04d}.bin" for i in range(40)]
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=8,
                              cache_dir=tmp_path / "disk", num_workers=0)
    first = [b.tolist() for b in loader]
    requests = faulty_server.stats()["requests"]
    second = [b.tolist() for b in loader]
    assert faulty_server.stats()["requests"] == requests  # epoch 2 came from disk
    assert first == second and loader.stats.cache["disk_hits"] == 40
    from aioloader.storage._diskcache import DiskCache

    big = []  # values this large live in files, so the cache's size moves by whole values
    (sample_dir / "cache-big").mkdir(exist_ok=True)  # not among the samples other tests list
    for i in range(12):
        (sample_dir / "cache-big" / f"{i}.bin").write_bytes(bytes([i]) * (40 << 10))
        big.append(f"{faulty_server.url}cache-big/{i}.bin")
    limit = DiskCache(tmp_path / "empty").size + 5 * (40 << 10)
    small = aioloader.Loader(aioloader.Files(big), batch_size=4, cache_dir=tmp_path / "small",
                             cache_limit=limit, num_workers=0,
                             concurrency=1)  # stored in order: reads in flight end in any
    list(small)
    kept = small.disk_cache
    assert kept is not None and 0 < len(kept) < 12 and kept.size <= limit
    assert kept.get(big[0], None, None) is None  # the oldest written went first


def named_segments(name: str) -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if f"-cache-{name}-" in n}


@pytest.mark.parametrize("ending", ["the other leaves first", "the other is killed"])
def test_one_named_cache_per_node_removed_by_the_last_process(ending: str) -> None:
    import multiprocessing
    import signal

    from decoders import cache_member

    name = f"node-{os.getpid()}-{ending.split()[-1]}"
    context = multiprocessing.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    first = aioloader.SharedCache(0.01, name=name)
    first.attach(10)
    first.put(1, np.arange(4))
    other = context.Process(target=cache_member, args=(name, commands, replies))
    other.start()
    try:
        assert replies.get(timeout=60) == [0, 1, 2, 3]  # one copy on the node, seen by both
        assert replies.get(timeout=60) == "stored"
        assert first.get(2).tolist() == [0, 1, 2]
        if ending == "the other is killed":
            os.kill(other.pid, signal.SIGKILL)
            other.join(10)
            assert named_segments(name)  # still in use by the first process
            first.close()
        else:
            first.close()
            assert named_segments(name)  # the other process still uses it
            commands.put("close")
            assert replies.get(timeout=60) == "closed"
        other.join(10)
        deadline = time.monotonic() + 10  # a dead member's zygote may still be looking
        while named_segments(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert named_segments(name) == set()
    finally:
        if other.is_alive():
            other.kill()
        first.close()
