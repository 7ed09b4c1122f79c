"""Packing a folder of images (or an im2rec `.lst`) into RecordIO or WebDataset tar shards.

Worker processes resize and re-encode images when asked (plain copies stay in this process:
that is I/O, and pickling would cost more than it saves); the main process writes records in
the (seeded) order, so the output is the same whatever the number of processes. Records are
shuffled by default, as im2rec does: a class-by-class file gives class-by-class batches to a
reader that streams it in order. Files are written under temporary names and renamed once
complete, so a failed or interrupted pack leaves no partial file under the final name.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import random
import signal
import sys
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from .. import recordio, tfrecord
from .._closing import Closing
from .._datasets.tarshards import INDEX_SUFFIX, index_document
from .._datasets.tfrecords import INDEX_SUFFIX as TFRECORD_INDEX


def process_context() -> multiprocessing.context.BaseContext:
    """forkserver on Linux (never plain fork: threads may be running), spawn elsewhere."""
    return multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")


FORMATS = {".rec": "rec", ".tar": "tar", ".tfrecord": "tfrecord"}
"""Output format by the suffix of the output name."""
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass(frozen=True)
class Item:
    index: int
    labels: tuple[float, ...]
    path: Path


@dataclass(frozen=True)
class ImageOptions:
    resize: int | None = None
    """Resize so the shorter edge has this many pixels (as im2rec --resize)."""
    quality: int | None = None
    """Re-encode JPEG with this quality; None keeps the original bytes when not resizing."""


def list_items(source: Path) -> list[Item]:
    """Items of a class-per-folder tree (labels 0.. by sorted folder name, as ImageFolder does)
    or of an im2rec list file: `index<TAB>label[<TAB>label...]<TAB>path`, paths relative to it."""
    if source.is_file():
        items = []
        try:
            lines = source.read_text().splitlines()
        except UnicodeDecodeError:
            raise ValueError(f"{source} is not an im2rec .lst file (not text)") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 3:
                raise ValueError(f"{source}:{number}: expected index, label(s) and path: {line!r}")
            path = Path(fields[-1])
            items.append(Item(int(fields[0]), tuple(float(f) for f in fields[1:-1]),
                              path if path.is_absolute() else source.parent / path))
        return items
    classes = sorted(p.name for p in source.iterdir() if p.is_dir())
    if not classes:
        raise ValueError(f"{source} has no class sub-folders and is not a .lst file")
    paths = [
        (label, path)
        for label, name in enumerate(classes)
        for path in sorted((source / name).rglob("*"))
        if path.suffix.lower() in IMAGE_SUFFIXES
    ]
    return [Item(i, (float(label),), path) for i, (label, path) in enumerate(paths)]


def load_image(job: tuple[Item, ImageOptions]) -> tuple[Item, bytes, str]:
    """(item, image bytes, file extension): runs in a worker process."""
    item, options = job
    data = item.path.read_bytes()
    extension = item.path.suffix.lower().lstrip(".")
    if options.resize is None and options.quality is None:
        return item, data, extension
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(f"Pillow is needed to resize or re-encode images: "
                          f"pip install 'aioloader[image]' ({e})") from None

    try:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        if options.resize is not None:
            scale = options.resize / min(image.size)
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.Resampling.BILINEAR)
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=options.quality or 95)
    except OSError as e:  # Pillow's errors for unreadable images name no file: name it
        raise ValueError(f"{item.path}: {e}") from None
    return item, out.getvalue(), "jpg"


def ignore_interrupt() -> None:
    """Pool processes leave Ctrl-C to the main process, which stops them (else each prints a
    KeyboardInterrupt traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _loaded(
    items: list[Item], options: ImageOptions, processes: int, what: str
) -> Iterator[tuple[Item, bytes, str]]:
    jobs = [(item, options) for item in items]
    progress = tqdm(total=len(items), desc=what, unit="img")
    copying = options.resize is None and options.quality is None
    with progress:
        if processes <= 1 or copying:  # copying bytes is I/O: processes only add pickling
            for job in jobs:
                yield load_image(job)
                progress.update()
            return
        with process_context().Pool(processes, initializer=ignore_interrupt) as pool:
            for loaded in pool.imap(load_image, jobs, chunksize=16):
                yield loaded
                progress.update()


def pack_recordio(
    source: Path,
    out: Path,
    options: ImageOptions = ImageOptions(),
    processes: int = 2,
    shuffle: bool = True,
    seed: int = 0,
) -> int:
    """Write OUT.rec and OUT.idx (MXNet's layout: IRHeader + image, id and key = item index)."""
    items = _ordered_items(source, shuffle, seed)
    with staged() as stage, recordio.Writer(stage(out), stage(out.with_suffix(".idx"))) as writer:
        for item, data, _ in _loaded(items, options, processes, f"packing {out.name}"):
            one_or_many = item.labels[0] if len(item.labels) == 1 else item.labels
            header = recordio.IRHeader(0, one_or_many, item.index, 0)
            writer.write(recordio.pack(header, data), key=item.index)
    return len(items)


def pack_tfrecord(
    source: Path,
    out: Path,
    options: ImageOptions = ImageOptions(),
    processes: int = 2,
    shuffle: bool = True,
    seed: int = 0,
) -> int:
    """Write OUT.tfrecord and its index beside it (OUT.tfrecord.idx, DALI's format): each
    record a `tf.train.Example` as TensorFlow's image datasets write them, `image/encoded`,
    `image/format` and `image/class/label` (int64, or float where a label is not whole)."""
    items = _ordered_items(source, shuffle, seed)
    index = out.with_name(out.name + TFRECORD_INDEX)
    with staged() as stage, tfrecord.Writer(stage(out), stage(index)) as writer:
        for item, data, extension in _loaded(items, options, processes, f"packing {out.name}"):
            labels = np.asarray(item.labels)
            whole = bool(np.all(labels == np.round(labels)))
            writer.write(tfrecord.example({
                "image/encoded": data, "image/format": extension,
                "image/class/label": labels.astype(np.int64 if whole else np.float32)}))
    return len(items)


def pack_tar(
    source: Path,
    out: Path,
    options: ImageOptions = ImageOptions(),
    processes: int = 2,
    shard_bytes: int = 256 << 20,
    shuffle: bool = True,
    seed: int = 0,
) -> list[Path]:
    """Write WebDataset shards OUT-000000.tar, ... of about `shard_bytes` each: per sample
    `<index>.<ext>` with the image and `<index>.cls` with the label(s); beside each, the index
    of where its samples start (`OUT-000000.tar.index.json`), so a reader divides epochs by
    samples without reading the shards first."""
    items = _ordered_items(source, shuffle, seed)
    with staged() as stage, _ShardWriter(out, shard_bytes, stage) as shards:
        for item, data, extension in _loaded(items, options, processes, f"packing {out.name}"):
            key = f"{item.index:09d}"
            labels = " ".join(f"{x:g}" for x in item.labels).encode()
            shards.add_sample([(f"{key}.{extension}", data), (f"{key}.cls", labels)])
    return shards.paths


def _ordered_items(source: Path, shuffle: bool, seed: int) -> list[Item]:
    """The items in packing order; each keeps its index, so ids still name the source file."""
    items = list_items(source)
    if not items:
        raise ValueError(f"no images in {source} (looked for {', '.join(sorted(IMAGE_SUFFIXES))})")
    if shuffle:
        random.Random(seed).shuffle(items)
    return items


@contextlib.contextmanager
def staged() -> Iterator[Callable[[Path], Path]]:
    """`stage(path)` gives a temporary name beside `path` to write to; when the block ends
    they are all renamed to their final names, or removed if it raised (Ctrl-C included)."""
    moves: list[tuple[Path, Path]] = []

    def stage(final: Path) -> Path:
        moves.append((final.with_name(f"{final.name}.partial-{os.getpid()}"), final))
        return moves[-1][0]

    try:
        yield stage
    except BaseException:
        for temporary, _ in moves:
            temporary.unlink(missing_ok=True)
        raise
    for temporary, final in moves:
        os.replace(temporary, final)


class _ShardWriter(Closing):
    """Tar shards named OUT-000000.tar, ...; a new one starts once `limit` bytes are written."""

    def __init__(self, out: Path, limit: int, stage: Callable[[Path], Path]) -> None:
        self._out = out
        self._limit = limit
        self._stage = stage
        self.paths: list[Path] = []
        self._file: BinaryIO | None = None
        self._tar: tarfile.TarFile | None = None
        self._starts: list[int] = []

    def add_sample(self, files: list[tuple[str, bytes]]) -> None:
        if self._tar is None or self._file is None or self._file.tell() >= self._limit:
            self._start_shard()
        assert self._tar is not None
        self._starts.append(self._tar.offset)
        for name, payload in files:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            self._tar.addfile(info, io.BytesIO(payload))

    def _start_shard(self) -> None:
        self.close()
        self.paths.append(self._out.with_name(f"{self._out.stem}-{len(self.paths):06d}.tar"))
        self._file = self._stage(self.paths[-1]).open("wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.GNU_FORMAT)  # noqa: SIM115 (closed by close())

    def close(self) -> None:
        if self._tar is not None and self._file is not None:
            self._tar.close()
            size = self._file.tell()
            self._file.close()
            shard = self.paths[-1]
            index = self._stage(shard.with_name(shard.name + INDEX_SUFFIX))
            index.write_text(index_document(shard.name, self._starts, size))
        self._tar = self._file = None
        self._starts = []

