"""Sample files and decode functions for the tests; importable by the decode processes."""

from __future__ import annotations

import os
import random
import signal
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import aioloader

SAMPLE_COUNT = 100


def sample_bytes(index: int) -> bytes:
    """Sample i: its index as 4 bytes, then 100 + i deterministic bytes."""
    body = np.random.default_rng(index).integers(0, 256, 100 + index, dtype=np.uint8).tobytes()
    return struct.pack("<I", index) + body


def write_samples(folder: Path, count: int) -> None:
    for i in range(count):
        (folder / f"{i:04d}.bin").write_bytes(sample_bytes(i))


def index_of(raw: bytes) -> int:
    return int(struct.unpack_from("<I", raw)[0])


def index_and_noise(raw: bytes, rng: np.random.Generator) -> dict[str, Any]:
    """A decode with augmentation: the result depends on the per-sample rng."""
    return {"index": index_of(raw), "noise": rng.normal(size=3).astype(np.float32)}


def whoami(raw: bytes) -> tuple[int, int, int, int, float, int]:
    time.sleep(0.005)  # slow enough that both processes get work
    info = aioloader.get_worker_info()
    assert info is not None
    legacy = int(np.random.randint(0, 2**31))
    return index_of(raw), info.id, info.num_workers, info.seed, random.random(), legacy


def refuse_to_start(worker_id: int) -> None:
    raise PermissionError(f"worker {worker_id} may not start")


def fail_on_seven(raw: bytes) -> int:
    index = index_of(raw)
    if index == 7:
        raise ZeroDivisionError("sample seven is cursed")
    return index


def die_on_five(raw: bytes) -> int:
    index = index_of(raw)
    if index == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return index


def mark_worker(folder: str, worker_id: int) -> None:
    Path(folder, f"worker-{worker_id}").write_text(str(os.getpid()))


def start_late(worker_id: int) -> None:
    """worker_init: worker 1 is ready a while after worker 0."""
    if worker_id == 1:
        time.sleep(0.2)


def slow_worker_id(raw: bytes) -> int:
    """Which worker decoded the sample, slowly: a part of 4 samples outlasts `start_late`."""
    time.sleep(0.25)
    info = aioloader.get_worker_info()
    assert info is not None
    return info.id


def as_array(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, np.uint8).copy()


def plus_noise(item: int, rng: np.random.Generator) -> tuple[int, float]:
    return item, float(rng.random())


def big_image(raw: bytes) -> np.ndarray:
    """A 3x64x64 float32 image (48 KiB) filled with the sample's index."""
    return np.full((3, 64, 64), index_of(raw), np.float32)


def jpeg_index(item: tuple[bytes, int]) -> int:
    """Decode a JPEG with Pillow (corrupt ones raise); the label rides along."""
    import io

    from PIL import Image

    raw, label = item
    with Image.open(io.BytesIO(raw)) as image:
        image.load()
    return label


def cache_member(name: str, commands: Any, replies: Any) -> None:
    """Another training process on the node: joins the named cache, reads what the first
    process stored, stores a sample of its own, and leaves when told to."""
    cache = aioloader.SharedCache(0.01, name=name)
    cache.attach(10)
    replies.put(cache.get(1).tolist() if 1 in cache else None)
    cache.put(2, np.arange(3))
    replies.put("stored")
    if commands.get(timeout=60) == "close":
        cache.close()
        replies.put("closed")


def slow_decode(raw: bytes) -> int:
    """20 ms of CPU per sample: a decode-bound loader."""
    until = time.perf_counter() + 0.02
    while time.perf_counter() < until:
        pass
    return index_of(raw)


def index_and_pid(raw: bytes) -> tuple[int, int]:
    return index_of(raw), os.getpid()


def stuck_on_five(raw: bytes) -> int:
    """Sample 5 never finishes decoding."""
    index = index_of(raw)
    if index == 5:
        time.sleep(3600)
    return index


def slow_index(raw: bytes) -> int:
    time.sleep(0.02)
    return index_of(raw)


def wave_was_loaded(raw: bytes) -> bool:
    """Whether `wave` was in the process before this decode imported it."""
    import sys

    loaded = "wave" in sys.modules
    import wave  # noqa: F401

    return loaded


def two_megabytes(raw: bytes) -> np.ndarray:
    """A 2 MiB float32 image filled with the sample's index (the raw file holds it)."""
    return np.full((512, 1024), index_of(raw), np.float32)


def stuck_on_five_a_while(raw: bytes) -> int:
    """Sample 5 takes 6 s: past a short decode_timeout, on a worker that cannot be
    interrupted (a Dask thread), yet free again soon after."""
    index = index_of(raw)
    if index == 5:
        time.sleep(6)
    return index


def two_megabytes_marked(item: tuple[bytes, str]) -> np.ndarray:
    """`two_megabytes`, leaving a file named by the sample's index in the folder given with
    it: which samples were decoded, whatever process or machine-local worker did it."""
    raw, folder = item
    (Path(folder) / str(index_of(raw))).touch()
    return two_megabytes(raw)


RELEASE = threading.Event()
"""Set to let `blocked_on_five_and_nine` return (a thread of this process cannot be killed)."""


def blocked_on_five_and_nine(raw: bytes) -> int:
    """Samples 5 and 9 block until RELEASE is set (60 s at most): two chunks of 4 that no
    executor can stop."""
    index = index_of(raw)
    if index in (5, 9):
        RELEASE.wait(60)
    return index


def slow_big_image(raw: bytes) -> np.ndarray:
    """`big_image`, 10 ms each: chunks wait for the decode process."""
    time.sleep(0.01)
    return big_image(raw)


def faults_reusing_buffers(raw: bytes) -> int:
    """Minor page faults while 16 MiB are taken in 1 MiB buffers and freed, four times over
    after a first round: next to none where the allocator keeps freed memory for reuse."""
    import resource

    def take_and_free() -> None:
        buffers = [np.ones(1 << 20, np.uint8) for _ in range(16)]
        del buffers

    take_and_free()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        take_and_free()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
