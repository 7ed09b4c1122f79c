"""Image pipelines for the decode processes: picklable steps that take the per-sample rng, and
`image_loader`, MXNet's ImageRecordIter in one call.

Steps pass either a lazily opened Pillow image (straight after `Decode`) or an HWC uint8/float
numpy array. A crop or resize that meets a lazily opened JPEG decodes it reduced (the JPEG's DCT
scaling by 1/2, 1/4 or 1/8) whenever the crop still gets at least the pixels it needs, so a 224
crop of a large photo does not decode every pixel; `decode_jpeg` uses simplejpeg where it is
installed and Pillow's draft mode otherwise.
Compose steps with `Compose([...])`; it calls each step with the rng when the step takes one.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._worker.decode import takes_rng

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Cast",
    "CenterCrop",
    "Compose",
    "Decode",
    "HorizontalFlip",
    "Layout",
    "Normalize",
    "RandomResizedCrop",
    "Resize",
    "SubtractMeanImage",
    "decode_jpeg",
    "image_loader",
    "image_pipeline",
    "to_array",
]

Image = Any
"""A Pillow image or an HWC numpy array."""
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def _pil() -> Any:
    try:
        from PIL import Image as PILImage
    except ImportError as e:
        raise ImportError(f"Pillow is needed to decode and transform images: "
                          f"pip install 'aioloader[image]' ({e})") from None

    return PILImage


def to_array(image: Image) -> npt.NDArray[Any]:
    """HWC RGB array of a Pillow image (decoding it if it is still lazy) or an array."""
    if isinstance(image, np.ndarray):
        return image
    if getattr(image, "format", None) == "JPEG":
        image = decode_jpeg(image)
    return np.asarray(image.convert("RGB"))


def decode_jpeg(image: Any, reduce: int = 1) -> Any:
    """Decode a JPEG opened lazily by `Decode`, at 1/`reduce` of its size when reduce > 1 (DCT
    scaling): simplejpeg (libjpeg-turbo) when it is installed, else Pillow's draft mode. The one
    place a JPEG is decoded, so the decoder is chosen here only."""
    full_w, full_h = image.size
    target = (math.ceil(full_w / reduce), math.ceil(full_h / reduce))
    try:
        import simplejpeg
    except ImportError:
        if reduce > 1:
            image.draft("RGB", target)
        return image.convert("RGB")
    return _pil().fromarray(
        simplejpeg.decode_jpeg(image.fp.getvalue(), "rgb", min_width=target[0],
                               min_height=target[1])
    )


def _resize_box(image: Image, box: tuple[int, int, int, int], size: tuple[int, int]) -> Image:
    """Crop `box` (left, top, right, bottom) and resize to `size` (width, height); a lazy JPEG is
    decoded at the smallest scale that keeps the box at least `size`."""
    PILImage = _pil()
    if isinstance(image, np.ndarray):
        image = PILImage.fromarray(image)
    elif getattr(image, "format", None) == "JPEG":  # as opened by Decode, not yet decoded
        full_w, full_h = image.size
        scale = min((box[2] - box[0]) / size[0], (box[3] - box[1]) / size[1])
        image = decode_jpeg(image, min(8, 2 ** int(math.log2(scale))) if scale >= 2 else 1)
        factor_w, factor_h = image.size[0] / full_w, image.size[1] / full_h
        box = (int(box[0] * factor_w), int(box[1] * factor_h),
               max(int(box[0] * factor_w) + 1, int(box[2] * factor_w)),
               max(int(box[1] * factor_h) + 1, int(box[3] * factor_h)))
    return image.convert("RGB").resize(size, PILImage.Resampling.BILINEAR, box=box)


def _size(image: Image) -> tuple[int, int]:
    """(width, height)."""
    if isinstance(image, np.ndarray):
        return image.shape[1], image.shape[0]
    width, height = image.size
    return int(width), int(height)


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


@dataclass(frozen=True)
class Decode:
    """JPEG/PNG bytes to a lazily opened image (decoded by the next step, reduced if it can);
    `to_array=True` decodes at once to HWC uint8 RGB (for a cached step)."""

    to_array: bool = False

    def __call__(self, raw: bytes) -> Image:
        image = _pil().open(io.BytesIO(raw))
        if self.to_array:
            return to_array(image)
        return image


@dataclass(frozen=True)
class RandomResizedCrop:
    """A random area (scale) and aspect ratio (ratio) of the image, resized to `size`."""

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __call__(self, image: Image, rng: np.random.Generator) -> Image:
        width, height = _size(image)
        for _ in range(10):
            area = width * height * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            crop_w, crop_h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                left = int(rng.integers(0, width - crop_w + 1))
                top = int(rng.integers(0, height - crop_h + 1))
                return _resize_box(image, (left, top, left + crop_w, top + crop_h),
                                   _pair(self.size))
        return CenterCrop(self.size, 1.0)(image)  # as torchvision falls back


@dataclass(frozen=True)
class CenterCrop:
    """The centre `fraction` of the shorter side (0.875 as in ImageNet evaluation), resized to
    `size`."""

    size: int | tuple[int, int]
    fraction: float = 0.875

    def __call__(self, image: Image) -> Image:
        width, height = _size(image)
        out_w, out_h = _pair(self.size)
        side = min(width, height) * self.fraction
        if out_w >= out_h:
            crop_w, crop_h = int(side), int(side * out_h / out_w)
        else:
            crop_w, crop_h = int(side * out_w / out_h), int(side)
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        return _resize_box(image, (left, top, left + crop_w, top + crop_h), (out_w, out_h))


@dataclass(frozen=True)
class Resize:
    """The shorter side to `shorter` pixels, keeping the aspect ratio."""

    shorter: int

    def __call__(self, image: Image) -> Image:
        width, height = _size(image)
        scale = self.shorter / min(width, height)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        return _resize_box(image, (0, 0, width, height), size)


@dataclass(frozen=True)
class HorizontalFlip:
    """Mirror left-right with probability `p`."""

    p: float = 0.5

    def __call__(self, image: Image, rng: np.random.Generator) -> npt.NDArray[Any]:
        array = to_array(image)
        return array[:, ::-1] if rng.random() < self.p else array


@dataclass(frozen=True)
class Normalize:
    """(pixel - mean) / std per channel, as float32 (or `dtype`), HWC."""

    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    dtype: str = "float32"

    def __call__(self, image: Image) -> npt.NDArray[Any]:
        array = to_array(image).astype(np.float32)
        array -= np.asarray(self.mean, np.float32)
        array /= np.asarray(self.std, np.float32)
        return array.astype(self.dtype, copy=False)


@dataclass(frozen=True)
class SubtractMeanImage:
    """pixel - mean image (HWC, the output's height and width), as MXNet's mean_img does."""

    mean_image: npt.NDArray[Any]

    def __call__(self, image: Image) -> npt.NDArray[np.float32]:
        return to_array(image).astype(np.float32) - self.mean_image.astype(np.float32)


@dataclass(frozen=True)
class Layout:
    """"CHW" (what PyTorch and MXNet take) or "HWC"; contiguous either way."""

    order: str = "CHW"

    def __call__(self, image: Image) -> npt.NDArray[Any]:
        array = to_array(image)
        if self.order == "CHW":
            array = array.transpose(2, 0, 1)
        elif self.order != "HWC":
            raise ValueError(f'layout must be "CHW" or "HWC", got {self.order!r}')
        return np.ascontiguousarray(array)


@dataclass(frozen=True)
class Cast:
    """The output dtype: uint8, float16 or float32."""

    dtype: str

    def __call__(self, image: Image) -> npt.NDArray[Any]:
        return to_array(image).astype(self.dtype, copy=False)


class Compose:
    """Steps run in order; a step that takes a second argument gets the sample's rng."""

    def __init__(self, steps: Sequence[Callable[..., Any]]) -> None:
        self.steps = list(steps)
        self._random = [takes_rng(step) for step in self.steps]

    def __call__(self, value: Any, rng: np.random.Generator | None = None) -> Any:
        for step, random in zip(self.steps, self._random, strict=True):
            if random:
                if rng is None:
                    raise ValueError(f"{type(step).__name__} is random: pass an rng")
                value = step(value, rng)
            else:
                value = step(value)
        return value


def image_pipeline(
    data_shape: tuple[int, int, int] = (3, 224, 224),
    rand_crop: bool = True,
    rand_mirror: bool = True,
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
    dtype: str = "float32",
    layout: str = "CHW",
) -> Compose:
    """Decode, crop (random resized, or centre), mirror, normalise, layout, dtype."""
    channels, height, width = data_shape
    if channels != 3:
        raise ValueError(f"data_shape must have 3 channels (RGB), got {channels}")
    size = (width, height)
    steps: list[Callable[..., Any]] = [Decode()]
    steps.append(RandomResizedCrop(size) if rand_crop else CenterCrop(size))
    if rand_mirror:
        steps.append(HorizontalFlip())
    if mean is not None:
        steps.append(Normalize(mean, std or (1.0, 1.0, 1.0), "float32"))
    steps += [Layout(layout), Cast(dtype)]
    return Compose(steps)


@dataclass(frozen=True)
class _Labelled:
    """(image bytes, label) of a raw item, whatever the source's layout; then the pipeline."""

    pipeline: Compose
    source: str
    label_dtype: str | None = None

    def __call__(self, raw: Any, rng: np.random.Generator) -> tuple[Any, Any]:
        if self.source == "rec":
            from .recordio import unpack

            header, payload = unpack(raw)
            label: Any = header.label
        elif self.source == "tar":
            payload = next(raw[k] for k in ("jpg", "jpeg", "png", "webp") if k in raw)
            label = _tar_label(raw)
        elif isinstance(raw, tuple):
            payload, label = raw
        else:
            payload, label = raw, -1
        return self.pipeline(payload, rng), _typed(label, self.label_dtype)


def _typed(label: Any, dtype: str | None) -> Any:
    """`label` as `dtype`; by default int64 when it is one whole number (a class index, which
    cross_entropy wants, though a .rec stores it as float32) and float32 otherwise."""
    try:
        array = np.asarray(label, np.float64)
    except (TypeError, ValueError):
        return label  # not numbers (class names, say): as they are
    if dtype is None:
        dtype = "int64" if array.ndim == 0 and float(array).is_integer() else "float32"
    return array.astype(dtype)[()]


def _tar_label(sample: dict[str, Any]) -> Any:
    if "cls" in sample:  # "3", or "0 1 1" for several labels
        values = [float(x) for x in bytes(sample["cls"]).split()]
        return values[0] if len(values) == 1 else values
    if "json" in sample:
        import json

        return json.loads(sample["json"]).get("label", -1)
    return -1


def image_loader(
    source: str | Sequence[str],
    data_shape: tuple[int, int, int] = (3, 224, 224),
    batch_size: int = 64,
    rand_crop: bool = True,
    rand_mirror: bool = True,
    mean: Sequence[float] | None = IMAGENET_MEAN,
    std: Sequence[float] | None = IMAGENET_STD,
    dtype: str = "float32",
    shuffle: bool = True,
    labels: Sequence[int] | None = None,
    label_dtype: str | None = None,
    **loader_options: Any,
) -> Any:
    """Batches of (images, labels) from `.rec` files (labels from the IRHeader), tar shards
    (labels from `cls`, or `label` in `json`), an image folder (a sub-folder per class, as
    ImageFolder) or a list of image URLs (`labels=` optional); other Loader arguments pass
    through (num_workers, concurrency, prefetch, cache, ...).

    Labels are int64 when a sample's label is one whole number, whatever the source, so class
    labels go straight into cross_entropy; float32 otherwise (fractional or several labels). A
    batch mixing the two is promoted, never truncated: for regression targets, give
    `label_dtype="float32"` (any numpy dtype name) to have every label in that dtype."""
    from ._datasets.sources import for_source
    from ._loader import Loader

    if label_dtype is not None:
        np.dtype(label_dtype)  # a typo fails here, not in a decode process
    dataset, kind = for_source(source, labels)
    pipeline = image_pipeline(data_shape, rand_crop, rand_mirror, mean, std, dtype)
    return Loader(dataset, decode=_Labelled(pipeline, kind, label_dtype), batch_size=batch_size,
                  shuffle=shuffle, **loader_options)
