"""Packing and reading packed formats: pack rate with 1 and 2 processes, and read rates over
HTTP with 20 ms latency for a .rec and a .tfrecord (each in order and shuffled), tar shards,
and one object per sample. All figures come from this one run.

    python benchmarks/formats.py [--images 2000] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks_common import samples_per_second

import aioloader
from aioloader._tools.images import make_images
from aioloader._tools.packing import ImageOptions, pack_recordio, pack_tar, pack_tfrecord
from aioloader.testing import TestServer

BATCH = 64


def length(raw: bytes) -> int:
    """A trivial decode: these benchmarks measure reading, not decoding."""
    return len(raw)


def class_tree(flat: Path, tree: Path, items: list[tuple[str, int]]) -> None:
    for name, label in items:
        folder = tree / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(flat / name, folder / name)


def pack_rates(tree: Path, work: Path, count: int) -> dict[str, float]:
    rates = {}
    for label, options, processes in (
        ("copy bytes (no processes: I/O only)", ImageOptions(), 1),
        ("resize 256 + JPEG q90, 1 process", ImageOptions(resize=256, quality=90), 1),
        ("resize 256 + JPEG q90, 2 processes", ImageOptions(resize=256, quality=90), 2),
    ):
        started = time.perf_counter()
        pack_recordio(tree, work / f"p{processes}.rec", options, processes)
        rates[f"pack .rec, {label}"] = count / (time.perf_counter() - started)
    return rates


def read_rate(dataset: aioloader.Dataset | aioloader.Stream, count: int, what: str,
              shuffle: bool = False) -> float:
    loader = aioloader.Loader(dataset, decode=length, batch_size=BATCH, shuffle=shuffle,
                              concurrency=256, num_workers=2)
    with loader:
        return samples_per_second(loader, count, what)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        items = make_images(work / "flat", args.images)
        class_tree(work / "flat", work / "tree", items)
        packing = pack_rates(work / "tree", work, len(items))
        served = work / "served"
        served.mkdir()
        pack_recordio(work / "tree", served / "train.rec", processes=2)
        shards = pack_tar(work / "tree", served / "train.tar", processes=2, shard_bytes=4 << 20)
        pack_tfrecord(work / "tree", served / "train.tfrecord", processes=2)
        read_rate(aioloader.RecordIO(str(served / "train.rec")), len(items), "warm-up")
        with TestServer(served, latency_ms=args.latency_ms) as server:
            for name, _ in items:
                (served / name).hardlink_to(work / "flat" / name)
            per_object = aioloader.Files([server.url + n for n, _ in items])
            indexed = aioloader.RecordIO(server.url + "train.rec", server.url + "train.idx")
            reading = {
                "one object per sample (Files), shuffled": read_rate(
                    per_object, len(items), "files", shuffle=True),
                ".rec + .idx, shuffled (one ranged read each)": read_rate(
                    indexed, len(items), "rec shuffled", shuffle=True),
            }
            before = server.stats()["requests"]
            reading[".rec + .idx, in order (neighbours merged)"] = read_rate(
                indexed, len(items), "rec in order")
            merged_requests = server.stats()["requests"] - before
            records = aioloader.TFRecord(server.url + "train.tfrecord")  # its .idx beside it
            reading[".tfrecord + .idx, shuffled (one ranged read each)"] = read_rate(
                records, len(items), "tfrecord shuffled", shuffle=True)
            reading[".tfrecord + .idx, in order (neighbours merged)"] = read_rate(
                records, len(items), "tfrecord in order")
            reading[f"tar shards ({len(shards)} of 4 MB), streamed"] = read_rate(
                aioloader.TarShards([server.url + p.name for p in shards]), len(items), "tar")

    print(f"\n{len(items)} JPEGs (300-640 x 240-480 px, quality 90), 2 cores")
    print("packing (images/s):")
    for name, rate in packing.items():
        print(f"  {name:<55} {rate:8.0f}")
    print(f"reading over HTTP, {args.latency_ms:g} ms latency, concurrency 256, batch {BATCH}, "
          "2 decode processes (samples/s):")
    base = reading["one object per sample (Files), shuffled"]
    for name, rate in reading.items():
        print(f"  {name:<55} {rate:8.0f}  {rate / base:5.1f}x")
    print(f"  (the in-order .rec epoch took {merged_requests} requests for {len(items)} records)")
    for order in ("shuffled (one ranged read each)", "in order (neighbours merged)"):
        ratio = reading[f".tfrecord + .idx, {order}"] / reading[f".rec + .idx, {order}"]
        print(f"  .tfrecord / .rec, {order.split(' (')[0]}: {ratio:.2f}")


if __name__ == "__main__":
    main()
