"""Demo images and the decode-and-augment function every image benchmark and the demo use.

Kept apart from the demo's orchestration so that a decode process unpickling
`decode_and_augment` imports numpy and Pillow, not the loader.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

CLASSES = 10
CROP = 224
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


def _pillow() -> tuple[Any, Any]:
    try:
        from PIL import Image, ImageDraw
    except ImportError as e:
        raise ImportError(f"Pillow is needed to make and decode the demo's images: "
                          f"pip install 'aioloader[image]' ({e})") from None
    return Image, ImageDraw


def make_images(
    folder: Path,
    count: int,
    seed: int = 0,
    dimensions: tuple[int, int] | None = None,
    by_class: bool = False,
    noise: float = 0.0,
) -> list[tuple[str, int]]:
    """JPEGs (quality 90) of varied sizes, or all of `dimensions` (width, height): smooth
    backgrounds with shapes; class = shape colour. `noise` adds a grain of that standard
    deviation, which makes the files as large and as slow to decode as photos (9 gives about
    46 KB at 500x375). `by_class` puts them in a sub-folder per class (as `aioloader pack`
    reads them). Returns (relative path, label) pairs; files already there are kept."""
    from tqdm import tqdm

    Image, ImageDraw = _pillow()

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
        pixels = np.broadcast_to(base, (height, width, 3))
        if noise:
            pixels = pixels + rng.normal(0, noise, size=(height, width, 3))
        pixels = pixels.clip(0, 255).astype(np.uint8)
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
    Image, _ = _pillow()
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
