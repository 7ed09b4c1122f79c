"""`aioloader demo`: data served by a local server that waits before every answer, as a remote
store does, loaded by aioloader and by a loader with one read in flight per worker process (as
PyTorch's DataLoader has), with the same number of processes.

First the headline, with the core dependencies only: small objects and a trivial decode, where
the reads in flight decide everything. Then an image pipeline (needs `aioloader[image]`): JPEGs,
decode and augment, where decoding takes its share.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._datasets import Files
from .._loader import Loader
from ..testing import TestServer
from .images import CROP, _pillow, decode_and_augment, make_images
from .packing import ignore_interrupt, process_context


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "aioloader"


def make_objects(folder: Path, count: int, size: int) -> list[str]:
    """`count` files of `size` random bytes; returns their names. Files already there are kept."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = [f"{i:06d}.bin" for i in range(count)]
    for name in tqdm(names, desc="making objects", unit="obj", leave=False):
        payload = rng.bytes(size)
        path = folder / name
        if not path.exists() or path.stat().st_size != size:
            path.write_bytes(payload)
    return names


def to_array(raw: bytes) -> npt.NDArray[np.uint8]:
    """The headline's decode: next to nothing, so only the reads count."""
    return np.frombuffer(raw, np.uint8)


def _fetch(url: str) -> int:
    """The one-read-per-worker way, for the headline: a blocking GET, then the same decode."""
    with urllib.request.urlopen(url, timeout=30) as response:
        return len(to_array(response.read()))


def _fetch_and_decode(job: tuple[str, int, int]) -> int:
    """The one-read-per-worker way: a blocking GET, then the same decode."""
    url, label, index = job
    with urllib.request.urlopen(url, timeout=30) as response:
        raw = response.read()
    sample = decode_and_augment((raw, label), np.random.default_rng([0, 0, index]))
    return int(sample["label"])


def aioloader_rate(loader: Loader, count: int, what: str) -> float:
    """Samples per second of one pass, starting its decode processes included (which only
    makes aioloader look slower)."""
    from tqdm import tqdm

    with loader, tqdm(total=count, desc=f"aioloader, {what}", unit=what, leave=False) as bar:
        started = time.perf_counter()
        for batch in loader:
            bar.update(len(batch["label"]) if isinstance(batch, dict) else len(batch))
        return count / (time.perf_counter() - started)


def pool_rate(job: Callable[[Any], int], jobs: Sequence[Any], processes: int, what: str) -> float:
    """Samples per second of `processes` worker processes doing one job at a time each,
    counted from the result that shows the last of them running: their start is left out."""
    from tqdm import tqdm

    started = time.perf_counter()
    done = []
    with process_context().Pool(processes, initializer=ignore_interrupt) as pool, tqdm(
        total=len(jobs), desc=f"one read per worker, {what}", unit=what, leave=False
    ) as bar:
        for _ in pool.imap_unordered(job, jobs, chunksize=1):
            done.append(time.perf_counter())
            bar.update()
    warm = done[processes - 1 :]
    if len(warm) < 2:  # too few jobs to leave the start out
        return len(done) / (done[-1] - started)
    return (len(warm) - 1) / (warm[-1] - warm[0])


def run_demo(
    objects: int = 8000,
    baseline_objects: int = 300,
    object_kib: int = 4,
    images: int = 512,
    baseline_images: int = 128,
    latency_ms: float = 20.0,
    num_workers: int = 2,
    concurrency: int = 256,
    cache_dir: Path | None = None,
) -> dict[str, float]:
    """Print one rate per loader for the headline, then for the image pipeline; returns them.
    The baselines read fewer samples than aioloader (at one read per worker they are slow):
    rates, not counts, are compared."""
    counts = {"objects": objects, "baseline_objects": baseline_objects,
              "object_kib": object_kib, "images": images, "baseline_images": baseline_images,
              "num_workers": num_workers, "concurrency": concurrency}
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not latency_ms >= 0:
        raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
    root = cache_dir or default_cache_dir()
    folder = f"demo-objects-{objects}x{object_kib}k"
    names = make_objects(root / folder, objects, object_kib << 10)
    rates: dict[str, float] = {}
    print(f"aioloader, and a loader with one read in flight per worker process (as PyTorch's "
          f"DataLoader),\nread from a local server that waits {latency_ms:g} ms before every "
          "answer, as a remote store does.\naioloader's times include starting its processes; "
          "the other loader's do not.\n", flush=True)
    with TestServer(root, latency_ms=latency_ms) as server:
        urls = [f"{server.url}{folder}/{name}" for name in names]
        loader = Loader(Files(urls), decode=to_array, batch_size=64, shuffle=True,
                        concurrency=concurrency, num_workers=num_workers)
        rates["aioloader_objects"] = aioloader_rate(loader, len(urls), "objects")
        jobs: Sequence[Any] = urls[:baseline_objects]
        rates["baseline_objects"] = pool_rate(_fetch, jobs, num_workers, "objects")
        print(f"Small objects: {object_kib} KiB each over HTTP, {latency_ms:g} ms latency, "
              "trivial decode, batch 64")
        _report("objects", rates["aioloader_objects"], rates["baseline_objects"],
                f"{len(urls)} objects, {concurrency} reads in flight, {num_workers} decode "
                "processes",
                f"{len(jobs)} objects, {num_workers} worker processes")
        try:
            _pillow()
        except ImportError as e:
            print(f"\nThe image pipeline is skipped: {e}")
            return rates
        folder = f"demo-images-{images}"
        items = make_images(root / folder, images)
        urls = [f"{server.url}{folder}/{name}" for name, _ in items]
        labels = [label for _, label in items]
        loader = Loader(Files(urls, labels), decode=decode_and_augment, batch_size=32,
                        shuffle=True, concurrency=concurrency, num_workers=num_workers)
        rates["aioloader_images"] = aioloader_rate(loader, len(urls), "images")
        jobs = [(urls[i], labels[i], i) for i in range(min(baseline_images, len(urls)))]
        rates["baseline_images"] = pool_rate(_fetch_and_decode, jobs, num_workers, "images")
    print(f"\nImages: JPEGs of 300-640 x 240-480 px over HTTP, {latency_ms:g} ms latency; "
          f"decode, random resized\ncrop to {CROP}, flip, normalise; batch 32")
    _report("images", rates["aioloader_images"], rates["baseline_images"],
            f"{len(urls)} images, {concurrency} reads in flight, {num_workers} decode processes",
            f"{len(jobs)} images, {num_workers} worker processes")
    return rates


def _report(unit: str, fast: float, slow: float, fast_setting: str, slow_setting: str) -> None:
    """One line per loader: its rate and its own conditions; then the ratio."""
    print(f"  aioloader            {fast:6.0f} {unit}/s  ({fast_setting})")
    print(f"  one read per worker  {slow:6.0f} {unit}/s  ({slow_setting})")
    print(f"  aioloader / one read per worker: {fast / slow:.1f}x", flush=True)
