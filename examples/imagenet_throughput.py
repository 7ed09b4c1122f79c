"""ImageNet-style throughput: `aioloader.vision.image_loader` from a `.rec` on disk and over
HTTP (20 ms latency), against PyTorch's DataLoader running the very same pipeline (decode,
random resized crop 224, mirror, normalise, CHW float32), 2 processes each, on this machine's
2 cores; the ceiling is twice the pipeline's rate in one process.

    python examples/imagenet_throughput.py [--images 1500]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from aioloader import recordio, vision
from aioloader._tools.images import make_images
from aioloader._tools.packing import pack_recordio
from aioloader.testing import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from benchmarks_common import samples_per_second

PIPELINE = vision.image_pipeline((3, 224, 224))
BATCH = 64


class RecordFile:
    """What a PyTorch user writes for a .rec: records by offset from the .idx, one read each
    (a local file, or an HTTP Range request), then the pipeline."""

    def __init__(self, rec: str, offsets: list[int], ends: list[int]) -> None:
        self.rec, self.offsets, self.ends = rec, offsets, ends
        self._session: Any = None

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, index: int) -> bytes:
        start, end = self.offsets[index], self.ends[index]
        if not self.rec.startswith("http"):
            with open(self.rec, "rb") as file:
                file.seek(start)
                return file.read(end - start)
        import requests

        if self._session is None or self._session[0] != os.getpid():  # not a parent's sockets
            self._session = (os.getpid(), requests.Session())
        headers = {"Range": f"bytes={start}-{end - 1}"}
        return self._session[1].get(self.rec, headers=headers, timeout=30).content

    def __getitem__(self, index: int) -> tuple[np.ndarray, float]:
        payload, _ = recordio.decode(self.read(index))
        header, image = recordio.unpack(payload)
        return PIPELINE(image, np.random.default_rng(index)), float(header.label)


def offsets_of(rec: Path) -> tuple[list[int], list[int]]:
    offsets = sorted(int(line.split("\t")[1])
                     for line in rec.with_suffix(".idx").read_text().splitlines())
    return offsets, [*offsets[1:], rec.stat().st_size]


def one_process_rate(dataset: RecordFile, count: int = 150) -> float:
    started = time.perf_counter()
    for i in range(count):
        dataset[i]
    return count / (time.perf_counter() - started)


def warm_epoch(make: Any, count: int, what: str) -> float:
    loader = make()
    with loader if hasattr(loader, "close") else contextlib.nullcontext():
        samples_per_second(loader, count, f"{what} epoch 1")
        return samples_per_second(loader, count, f"{what} epoch 2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1500)
    args = parser.parse_args()
    import torch.utils.data

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        make_images(root / "images", args.images, dimensions=(500, 375), by_class=True)
        pack_recordio(root / "images", root / "train.rec", processes=2)
        offsets, ends = offsets_of(root / "train.rec")
        local = RecordFile(str(root / "train.rec"), offsets, ends)
        single = one_process_rate(local)
        rates = {
            "aioloader image_loader, disk": warm_epoch(
                lambda: vision.image_loader(str(root / "train.rec"), batch_size=BATCH,
                                            num_workers=2, persistent_workers=True),
                args.images, "aioloader disk"),
            "PyTorch DataLoader, disk": warm_epoch(
                lambda: torch.utils.data.DataLoader(local, batch_size=BATCH, shuffle=True,
                                                    num_workers=2, persistent_workers=True),
                args.images, "DataLoader disk"),
        }
        with TestServer(root, latency_ms=20) as server:
            remote = RecordFile(server.url + "train.rec", offsets, ends)
            rates["aioloader image_loader, HTTP 20 ms"] = warm_epoch(
                lambda: vision.image_loader(server.url + "train.rec", batch_size=BATCH,
                                            num_workers=2, concurrency=128,
                                            persistent_workers=True),
                args.images, "aioloader http")
            rates["PyTorch DataLoader, HTTP 20 ms"] = warm_epoch(
                lambda: torch.utils.data.DataLoader(remote, batch_size=BATCH, shuffle=True,
                                                    num_workers=2, persistent_workers=True),
                args.images, "DataLoader http")
    ceiling = 2 * single
    print(f"\n{args.images} JPEGs 500x375 in a .rec; decode + random resized crop 224 + mirror + "
          "normalise, CHW float32; batch 64; 2 processes; second epoch")
    print(f"  one process: {single:.0f} images/s; ceiling for 2 cores: {ceiling:.0f}")
    for name, rate in rates.items():
        print(f"  {name:<38} {rate:6.0f} images/s  {rate / ceiling:5.0%} of the ceiling")


if __name__ == "__main__":
    main()
