"""aioloader.vision: the steps, reduced JPEG decoding, and image_loader from every source."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

import aioloader
from aioloader import vision
from aioloader._tools.packing import pack_recordio, pack_tar
from aioloader.testing import TestServer

PIL = pytest.importorskip("PIL.Image")


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def image_tree(root: Path, per_class: int = 6) -> None:
    for label in range(2):
        (root / f"c{label}").mkdir(parents=True)
        for i in range(per_class):
            (root / f"c{label}" / f"{i}.jpg").write_bytes(jpeg(60 + i, 48, seed=label * 10 + i))


def test_pipeline_shapes_dtypes_and_determinism() -> None:
    raw = jpeg(120, 90)
    for layout, dtype, shape in (("CHW", "float32", (3, 32, 40)), ("HWC", "uint8", (32, 40, 3))):
        pipeline = vision.Compose([
            vision.Decode(), vision.RandomResizedCrop((40, 32)), vision.HorizontalFlip(),
            vision.Layout(layout), vision.Cast(dtype),
        ])
        first = pipeline(raw, np.random.default_rng(1))
        assert first.shape == shape and first.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(first, pipeline(raw, np.random.default_rng(1)))
    normalised = vision.image_pipeline((3, 16, 16), dtype="float16")(raw, np.random.default_rng(0))
    assert normalised.shape == (3, 16, 16) and normalised.dtype == np.float16
    assert abs(float(normalised.astype(np.float32).mean())) < 3


def test_mirror_flips_and_mean_image_subtracts() -> None:
    array = np.arange(2 * 3 * 3).reshape(2, 3, 3).astype(np.uint8)
    flipped = vision.HorizontalFlip(p=1.0)(array, np.random.default_rng(0))
    np.testing.assert_array_equal(flipped, array[:, ::-1])
    mean = np.ones((2, 3, 3), np.float32)
    np.testing.assert_array_equal(vision.SubtractMeanImage(mean)(array), array - 1.0)


@pytest.mark.parametrize("decoder", ["simplejpeg", "pillow"])
def test_a_small_crop_of_a_large_jpeg_decodes_at_reduced_size(
    decoder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if decoder == "pillow":
        monkeypatch.setitem(sys.modules, "simplejpeg", None)  # as if not installed
    else:
        pytest.importorskip("simplejpeg")
    raw = jpeg(2000, 1500)
    assert vision.decode_jpeg(vision.Decode()(raw), 4).size == (500, 375)
    assert vision.decode_jpeg(vision.Decode()(raw)).size == (2000, 1500)
    crop = vision.CenterCrop(224, fraction=1.0)(vision.Decode()(raw))
    full = vision.CenterCrop(224, fraction=1.0)(vision.to_array(vision.Decode()(raw)))
    assert crop.size == full.size == (224, 224)
    difference = np.abs(np.asarray(crop, np.float32) - np.asarray(full, np.float32)).mean()
    assert difference < 40  # the same picture, from fewer pixels (noise images differ most)


def packed(images: Path, source: str, out: Path) -> str | list[str]:
    """`images` (a class-per-folder tree or an im2rec .lst) as `source`: folder, rec or tar."""
    if source == "folder":
        return str(images)
    if source == "rec":
        pack_recordio(images, out / "train.rec", processes=1)
        return str(out / "train.rec")
    shards = pack_tar(images, out / "train.tar", processes=1, shard_bytes=4096)
    return [str(p) for p in shards]


@pytest.mark.parametrize("source", ["folder", "rec", "tar", "urls"])
def test_image_loader_from_every_source(tmp_path: Path, source: str) -> None:
    image_tree(tmp_path / "images")
    expected = sorted([0] * 6 + [1] * 6)
    server = None
    if source != "urls":
        where: str | list[str] = packed(tmp_path / "images", source, tmp_path)
    else:
        server = TestServer(tmp_path / "images")
        names = [f"c{label}/{i}.jpg" for label in range(2) for i in range(6)]
        where = [server.url + name for name in names]
    try:
        labels = [label for label in range(2) for _ in range(6)] if source == "urls" else None
        loader = vision.image_loader(where, data_shape=(3, 24, 24), batch_size=4, labels=labels,
                                     num_workers=1)
        with loader:
            batches = list(loader)
    finally:
        if server is not None:
            server.close()
    images = np.concatenate([b[0] for b in batches])
    got = sorted(int(x) for b in batches for x in b[1])
    assert images.shape == (12, 3, 24, 24) and images.dtype == np.float32
    assert got == expected


def test_corrupt_images_name_the_key_or_are_skipped(tmp_path: Path) -> None:
    image_tree(tmp_path / "images", per_class=2)
    (tmp_path / "images" / "c1" / "9.jpg").write_bytes(jpeg(50, 40)[:200])
    with pytest.raises(aioloader.LoaderError, match=r"9\.jpg"):
        list(vision.image_loader(str(tmp_path / "images"), data_shape=(3, 8, 8), batch_size=2,
                                 shuffle=False, num_workers=0))
    loader = vision.image_loader(str(tmp_path / "images"), data_shape=(3, 8, 8), batch_size=2,
                                 num_workers=0, on_error="skip")
    assert sum(len(b[1]) for b in loader) == 4 and loader.stats.skipped == 1


def labels_of(where: str | list[str], label_dtype: str | None = None) -> np.ndarray:
    loader = vision.image_loader(where, data_shape=(3, 8, 8), batch_size=4, shuffle=False,
                                 label_dtype=label_dtype, num_workers=0)
    with loader:
        (batch,) = list(loader)
    labels: np.ndarray = batch[1]
    return labels


@pytest.mark.parametrize("source", ["rec", "tar", "folder"])
def test_class_labels_go_into_cross_entropy_from_every_source(
    tmp_path: Path, source: str
) -> None:
    """A .rec stores class labels as float32; cross_entropy refuses float class indices."""
    torch = pytest.importorskip("torch")
    from aioloader.torch import TorchLoader

    image_tree(tmp_path / "images", per_class=2)
    where = packed(tmp_path / "images", source, tmp_path)
    loader = vision.image_loader(where, data_shape=(3, 8, 8), batch_size=4, num_workers=0)
    with TorchLoader(loader) as batches:
        ((_, labels),) = list(batches)
    assert labels.dtype == torch.int64 and sorted(labels.tolist()) == [0, 0, 1, 1]
    logits = torch.zeros(len(labels), 2, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    loss.backward()
    assert loss.item() == pytest.approx(np.log(2))
    assert labels_of(where, "float32").dtype == np.float32


def write_list(tmp_path: Path, labels: list[str]) -> Path:
    """An im2rec .lst of the tree's four images with these label fields."""
    image_tree(tmp_path / "images", per_class=2)
    paths = [f"images/c{c}/{i}.jpg" for c in range(2) for i in range(2)]
    pairs = enumerate(zip(labels, paths, strict=True))
    lines = [f"{n}\t{label}\t{path}" for n, (label, path) in pairs]
    (tmp_path / "train.lst").write_text("\n".join(lines) + "\n")
    return tmp_path / "train.lst"


@pytest.mark.parametrize("source", ["rec", "tar"])
def test_fractional_labels_are_never_truncated_and_multi_labels_stay_float32(
    tmp_path: Path, source: str
) -> None:
    fractional = write_list(tmp_path / "fractional", ["1", "0.5", "2", "3.25"])
    where = packed(fractional, source, tmp_path / "fractional")
    mixed = labels_of(where)  # whole and fractional labels in one batch
    assert mixed.dtype.kind == "f" and sorted(mixed.tolist()) == [0.5, 1, 2, 3.25]
    regression = labels_of(where, "float32")
    assert regression.dtype == np.float32 and sorted(regression.tolist()) == [0.5, 1, 2, 3.25]
    several = write_list(tmp_path / "several", ["1\t0\t1", "0\t0\t1", "1\t1\t1", "0\t0\t0"])
    multi = labels_of(packed(several, source, tmp_path / "several"))
    assert multi.dtype == np.float32 and multi.shape == (4, 3)
    assert sorted(multi.sum(axis=1).tolist()) == [0, 1, 2, 3]
