"""The stochastic cache: epochs 1-3 with 0%, 25%, 50% and 100% of the decoded images fitting.

JPEG decode (500x375, quality 90) to uint8 is the cached step; random resized crop 224, flip
and float32 normalisation run every epoch. 2 decode processes, batch 64, local files.

    python benchmarks/cache.py [--images 800]
"""

from __future__ import annotations

import argparse
import io
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from benchmarks_common import samples_per_second
from PIL import Image

import aioloader
from aioloader._tools.images import CROP, MEAN, STD, make_images


def decode_jpeg(item: tuple[bytes, int]) -> tuple[np.ndarray, int]:
    raw, label = item
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")), label


def crop_flip_normalise(value: tuple[np.ndarray, int], rng: np.random.Generator) -> dict[str, Any]:
    pixels, label = value
    height, width = pixels.shape[:2]
    side = int(min(height, width) * rng.uniform(0.5, 1.0))
    top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
    crop = Image.fromarray(pixels[top : top + side, left : left + side])
    out = np.asarray(crop.resize((CROP, CROP), Image.Resampling.BILINEAR), np.float32)
    if rng.random() < 0.5:
        out = out[:, ::-1]
    return {"image": np.ascontiguousarray(((out - MEAN) / STD).transpose(2, 0, 1)),
            "label": label}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=800)
    args = parser.parse_args()
    decoded_bytes = 500 * 375 * 3 + 512  # image and its pickle header, per sample
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        items = make_images(Path(folder), args.images, dimensions=(500, 375))
        files = aioloader.Files([str(Path(folder) / n) for n, _ in items],
                                [label for _, label in items])
        for fraction in (0.0, 0.25, 0.5, 1.0):
            limit = max(fraction * args.images * decoded_bytes * 1.01, 4096) / (1 << 30)
            with aioloader.SharedCache(limit) as cache:
                loader = aioloader.Loader(files, decode=decode_jpeg, augment=crop_flip_normalise,
                                          cache=cache, batch_size=64, shuffle=True,
                                          num_workers=2, persistent_workers=True)
                with loader:
                    rows[fraction] = [samples_per_second(loader, args.images, f"{fraction:.0%}")
                                      for _ in range(3)]
                    cached = loader.stats.cache["samples"]
            print(f"{fraction:4.0%} fits: {cached:.0f} of {args.images} cached")
    print(f"\n{args.images} JPEGs 500x375; cached: decode to uint8; every epoch: crop 224, flip, "
          "normalise; 2 decode processes (images/s)")
    print("  cached     epoch 1   epoch 2   epoch 3   epoch 3 / no cache")
    for fraction, rates in rows.items():
        print(f"  {fraction:5.0%}   " + "".join(f"{r:9.0f} " for r in rates)
              + f"  {rates[2] / rows[0.0][2]:8.2f}x")


if __name__ == "__main__":
    main()
