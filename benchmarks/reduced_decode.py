"""What decoding a JPEG at reduced size saves when the crop allows it: a 224 centre crop of a
2000x1500 photo, full decode then crop, against aioloader.vision's reduced (draft) decode.

    python benchmarks/reduced_decode.py
"""

from __future__ import annotations

import importlib.util
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from aioloader import vision

ROUNDS = 30


def photo_like_jpeg(width: int, height: int) -> bytes:
    x = np.linspace(0, 255, width)[None, :, None]
    y = np.linspace(0, 255, height)[:, None, None]
    noise = np.random.default_rng(0).normal(0, 8, (height, width, 3))
    pixels = (0.5 * x + 0.5 * y + noise).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def milliseconds(function: Callable[[bytes], Any], raw: bytes) -> float:
    started = time.perf_counter()
    for _ in range(ROUNDS):
        function(raw)
    return (time.perf_counter() - started) / ROUNDS * 1e3


def main() -> None:
    raw = photo_like_jpeg(2000, 1500)
    crop = vision.CenterCrop(224)
    full = milliseconds(lambda r: crop(np.asarray(Image.open(io.BytesIO(r)).convert("RGB"))), raw)
    reduced = milliseconds(lambda r: crop(vision.Decode()(r)), raw)
    print(f"2000x1500 JPEG (q90) -> 224 centre crop, one process, mean of {ROUNDS}:")
    print(f"  Pillow full decode, then crop          {full:6.1f} ms")
    decoder = "simplejpeg" if importlib.util.find_spec("simplejpeg") else "Pillow draft"
    print(f"  vision: reduced decode ({decoder:<12})  {reduced:6.1f} ms   "
          f"{full / reduced:.1f}x faster")
    sys.modules["simplejpeg"] = None  # type: ignore[assignment]
    draft = milliseconds(lambda r: crop(vision.Decode()(r)), raw)
    print(f"  vision: reduced decode (Pillow draft)  {draft:6.1f} ms   {full / draft:.1f}x faster")


if __name__ == "__main__":
    main()
