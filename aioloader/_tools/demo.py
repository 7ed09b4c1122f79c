"""`aioloader demo`: a small realistic image set served with latency, loaded two ways.

Needs Pillow and tqdm (`pip install 'aioloader[image,dev]'`).
"""

from __future__ import annotations

import io
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._datasets import Files
from .._loader import Loader
from ..testing import TestServer
from .packing import process_context

CLASSES = 10
CROP = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "aioloader"


def make_images(
    folder: Path,
    count: int,
    seed: int = 0,
    dimensions: tuple[int, int] | None = None,
    by_class: bool = False,
) -> list[tuple[str, int]]:
    """JPEGs (quality 90) of varied sizes, or all of `dimensions` (width, height): smooth
    backgrounds with shapes; class = shape colour. `by_class` puts them in a sub-folder per
    class (as `aioloader pack` reads them). Returns (relative path, label) pairs; files already
    there are kept."""
    from PIL import Image, ImageDraw
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    palette = rng.integers(0, 256, size=(CLASSES, 3))
    items = []
    for i in tqdm(range(count), desc="making images", unit="img", leave=False):
        label = int(rng.integers(CLASSES))
        width, height = dimensions or (int(rng.integers(300, 640)), int(rng.integers(240, 480)))
        name = f"class{label}/{i:06d}.jpg" if by_class else f"{i:06d}_{label}.jpg"
        items.append((name, label))
        if (folder / name).exists():
            continue
        (folder / name).parent.mkdir(exist_ok=True)
        ramp = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
        base = rng.integers(0, 256, size=(1, 1, 3)) * ramp + rng.integers(0, 128, size=3)
        pixels = np.broadcast_to(base, (height, width, 3)).clip(0, 255).astype(np.uint8)
        image = Image.fromarray(pixels)
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(3, 9))):
            x, y = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
            size = int(rng.integers(20, 160))
            draw.ellipse((x, y, x + size, y + size), fill=tuple(int(c) for c in palette[label]))
        image.save(folder / name, quality=90)
    return items


def decode_and_augment(item: tuple[bytes, int], rng: np.random.Generator) -> dict[str, Any]:
    """JPEG decode, random resized crop to 224, random flip, float32 normalise, CHW."""
    from PIL import Image

    raw, label = item
    image = Image.open(io.BytesIO(raw)).convert("RGB")
    width, height = image.size
    area = width * height * rng.uniform(0.08, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    crop_w = int(min(width, round(np.sqrt(area * aspect))))
    crop_h = int(min(height, round(np.sqrt(area / aspect))))
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    image = image.resize((CROP, CROP), Image.Resampling.BILINEAR,
                         box=(left, top, left + crop_w, top + crop_h))
    pixels: npt.NDArray[np.float32] = np.asarray(image, dtype=np.float32)
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    pixels = (pixels - MEAN) / STD
    return {"image": np.ascontiguousarray(pixels.transpose(2, 0, 1)), "label": label}


def _fetch_and_decode(job: tuple[str, int, int]) -> int:
    """The one-read-per-worker way: a blocking GET, then the same decode."""
    url, label, index = job
    with urllib.request.urlopen(url, timeout=30) as response:
        raw = response.read()
    sample = decode_and_augment((raw, label), np.random.default_rng([0, 0, index]))
    return int(sample["label"])


def run_demo(
    images: int = 1024,
    latency_ms: float = 20.0,
    num_workers: int = 2,
    concurrency: int = 64,
    baseline_images: int = 256,
    cache_dir: Path | None = None,
) -> dict[str, float]:
    """Generate, serve, load with aioloader, then with one read per worker; print a report."""
    from tqdm import tqdm

    folder = (cache_dir or default_cache_dir()) / f"demo-images-{images}"
    items = make_images(folder, images)
    with TestServer(folder, latency_ms=latency_ms) as server:
        urls = [server.url + name for name, _ in items]
        labels = [label for _, label in items]
        loader = Loader(Files(urls, labels), decode=decode_and_augment, batch_size=32,
                        shuffle=True, concurrency=concurrency, num_workers=num_workers)
        with loader, tqdm(total=len(urls), desc="aioloader", unit="img") as progress:
            started = time.perf_counter()
            for batch in loader:
                progress.update(len(batch["label"]))
            fast = len(urls) / (time.perf_counter() - started)

        jobs = [(urls[i], labels[i], i) for i in range(min(baseline_images, len(urls)))]
        context = process_context()
        with context.Pool(num_workers) as pool, tqdm(
            total=len(jobs), desc="one read per worker", unit="img"
        ) as progress:
            started = time.perf_counter()
            for _ in pool.imap_unordered(_fetch_and_decode, jobs, chunksize=1):
                progress.update()
            slow = len(jobs) / (time.perf_counter() - started)

    print(f"\n{len(urls)} JPEGs over HTTP with {latency_ms:g} ms latency per request, "
          f"decode + random resized crop {CROP} + flip + normalise, {num_workers} decode processes")
    print(f"  aioloader (concurrency {concurrency}):     {fast:8.1f} images/s")
    print(f"  one read per worker ({num_workers} processes): {slow:8.1f} images/s")
    print(f"  ratio: {fast / slow:.1f}x")
    print(f"  loader stats: {loader.stats}")
    return {"aioloader": fast, "one_read_per_worker": slow}
