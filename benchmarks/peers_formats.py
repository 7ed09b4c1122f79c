"""The data of benchmarks/peers.py: the JPEGs, and each loader's native format written by its
own writer into a local folder, ready to upload.

Every format holds the same JPEG bytes and labels, in shards of about the same size.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aioloader._tools.images import make_images

DIMENSIONS = (500, 375)


@dataclass
class Images:
    """The JPEG files (cached between runs) and their labels, in index order."""

    folder: Path
    names: list[str]
    labels: list[int]

    def paths(self) -> list[Path]:
        return [self.folder / name for name in self.names]

    def samples(self) -> Iterator[tuple[int, bytes, int]]:
        """(index, JPEG bytes, label) for every image."""
        for index, (path, label) in enumerate(zip(self.paths(), self.labels, strict=True)):
            yield index, path.read_bytes(), label

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.paths())


GRAIN = 9.0
"""Noise that makes the JPEGs photo-like: about 46 KB each at quality 90, slow to decode."""


def load_images(cache: Path, count: int) -> Images:
    """`count` JPEGs of 500x375 at quality 90 (about 46 KB), made once and kept in `cache`."""
    folder = cache / f"peers-photos-{count}"
    items = make_images(folder, count, dimensions=DIMENSIONS, noise=GRAIN)
    return Images(folder, [name for name, _ in items], [label for _, label in items])


def shard_bytes(images: Images, target: int) -> int:
    """`target`, but small enough that there are at least 4 shards, so that small runs still
    spread shards across 2 workers."""
    return max(64 << 10, min(target, images.total_bytes() // 4))


# --- LitData ---


def litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    """litdata.optimize's fn: the JPEG's bytes, unchanged, and its label."""
    path, label = item
    return {"image": Path(path).read_bytes(), "label": label}


def write_litdata(images: Images, folder: Path, size: int) -> None:
    import litdata

    inputs = [(str(path), label) for path, label in zip(images.paths(), images.labels,
                                                         strict=True)]
    litdata.optimize(fn=litdata_sample, inputs=inputs, output_dir=str(folder), chunk_bytes=size,
                     num_workers=2, verbose=False, mode="overwrite")


# --- MosaicML Streaming ---


def import_streaming_base() -> Any:
    """`streaming.base`, without running `streaming/__init__.py` when torchvision can't be
    imported: that file imports streaming.vision, which imports torchvision, and PyPI's
    torchvision does not load beside a CPU-only torch build. Nothing in streaming.base needs
    it."""
    import importlib
    import importlib.util
    import sys
    import types

    if "streaming" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("mosaicml-streaming is not installed")
        shell = types.ModuleType("streaming")
        shell.__path__ = list(spec.submodule_search_locations)
        shell.__spec__ = spec
        sys.modules["streaming"] = shell
    return importlib.import_module("streaming.base")


def write_mds(images: Images, folder: Path, size: int) -> None:
    base = import_streaming_base()
    columns = {"image": "bytes", "label": "int"}
    with base.MDSWriter(out=str(folder), columns=columns, size_limit=size) as writer:
        for _, raw, label in images.samples():
            writer.write({"image": raw, "label": label})


# --- WebDataset ---


def write_webdataset(images: Images, folder: Path, size: int) -> None:
    import webdataset

    folder.mkdir(parents=True, exist_ok=True)
    with webdataset.ShardWriter(str(folder / "shard-%06d.tar"), maxsize=size, verbose=0) as sink:
        for index, raw, label in images.samples():
            sink.write({"__key__": f"{index:06d}", "jpg": raw, "cls": label})


# --- aioloader's formats ---


class Rolling:
    """Numbered files of about `size` bytes each: `open(n)` makes file n, `close` ends one."""

    def __init__(self, size: int, open_file: Callable[[int], Any]) -> None:
        self.size, self.open_file = size, open_file
        self.current: Any = None
        self.written = self.files = 0

    def next_for(self, nbytes: int) -> Any:
        """The file to write the next `nbytes` to: a new one when this one is full."""
        if self.current is None or (self.written and self.written + nbytes > self.size):
            self.close()
            self.current, self.written = self.open_file(self.files), 0
            self.files += 1
        self.written += nbytes
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


def add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    archive.addfile(info, io.BytesIO(data))


def tar_shard(folder: Path, number: int) -> tarfile.TarFile:
    return tarfile.open(folder / f"shard-{number:03d}.tar", "w", format=tarfile.USTAR_FORMAT)


def write_tar(images: Images, folder: Path, size: int) -> None:
    """WebDataset's layout with Python's tarfile: `key.jpg` and `key.cls` side by side."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = Rolling(size, lambda n: tar_shard(folder, n))
    try:
        for index, raw, label in images.samples():
            archive = shards.next_for(len(raw) + 2048)
            add_member(archive, f"{index:06d}.jpg", raw)
            add_member(archive, f"{index:06d}.cls", str(label).encode())
    finally:
        shards.close()


class RecordFiles:
    """One `.rec` + `.idx` pair, closed together."""

    def __init__(self, folder: Path, number: int) -> None:
        from aioloader.recordio import Writer

        self.writer = Writer(folder / f"part-{number:03d}.rec", folder / f"part-{number:03d}.idx")

    def close(self) -> None:
        self.writer.close()


def write_recordio(images: Images, folder: Path, size: int) -> None:
    """MXNet's image records (IRHeader with the label, then the JPEG) in `.rec` files with
    `.idx` files, written by aioloader.recordio.Writer."""
    from aioloader.recordio import IRHeader, pack

    folder.mkdir(parents=True, exist_ok=True)
    parts = Rolling(size, lambda n: RecordFiles(folder, n))
    try:
        for index, raw, label in images.samples():
            record = pack(IRHeader(0, float(label), index, 0), raw)
            parts.next_for(len(record) + 8).writer.write(record, key=index)
    finally:
        parts.close()


WRITERS: dict[str, Callable[[Images, Path, int], None]] = {
    "litdata": write_litdata,
    "mds": write_mds,
    "wds": write_webdataset,
    "tar": write_tar,
    "rec": write_recordio,
}
"""Bucket folder -> its writer. The folder `files` holds the JPEGs as they are."""


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())
