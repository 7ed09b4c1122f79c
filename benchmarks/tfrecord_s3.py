"""TFRecord over S3 at 20 ms per request: aioloader's `TFRecord` against what a PyTorch user
writes (a map-style dataset over the index, one ranged `get_object` per record with boto3, in
DataLoader's workers), and against aioloader's `RecordIO` over the same records, in one run.

Records of 100 KB in 8 files, each with its index (DALI's `tfrecord2idx` format; `.idx` for
the `.rec`), in moto's S3 server behind the proxy of `peers_s3.py`, which serves the bodies
itself and waits 20 ms before each answer. Batch 64, shuffled, 2 decode processes (2 workers
for DataLoader); decode unframes the record and checks its CRCs on both sides. aioloader's two
formats are each read twice, in one order then the other (the first pass of a run pays for
starting up), and the faster of each is kept.

    python benchmarks/tfrecord_s3.py [--records 4000] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from benchmarks_common import samples_per_second
from peers_s3 import PerProcessS3, Servers, upload

import aioloader
from aioloader import recordio, tfrecord

FILES = 8
RECORD = 100_000
BATCH = 64


def first_byte(raw: bytes) -> int:
    return raw[0]


class RangedTFRecords(PerProcessS3):
    """A DataLoader user's TFRecord on S3: the index read once, one ranged GET per record."""

    def __init__(self, endpoint: str, bucket: str, keys: list[str],
                 where: list[tuple[int, int, int]]) -> None:
        super().__init__(endpoint, bucket)
        self.keys, self.where = keys, where

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, index: int) -> int:
        file, start, size = self.where[index]
        body = self.client().get_object(Bucket=self.bucket, Key=self.keys[file],
                                        Range=f"bytes={start}-{start + size - 1}")["Body"].read()
        payload, _ = tfrecord.unframe(body, self.keys[file], start)
        return first_byte(payload)


def write(folder: Path, count: int) -> tuple[list[Path], list[tuple[int, int, int]]]:
    """The records in FILES .tfrecord files with their indexes, and as many .rec files with
    theirs; where each record lies in the .tfrecord files."""
    rng = np.random.default_rng(0)
    paths, where = [], []
    per_file = -(-count // FILES)
    for n in range(FILES):
        names = [folder / f"part-{n}.tfrecord", folder / f"part-{n}.tfrecord.idx",
                 folder / f"part-{n}.rec", folder / f"part-{n}.idx"]
        with tfrecord.Writer(names[0], names[1]) as tf, recordio.Writer(names[2], names[3]) as rec:
            for _ in range(min(per_file, count - n * per_file)):
                body = rng.integers(0, 256, RECORD, np.uint8).tobytes()
                start = tf.write(body)
                where.append((n, start, len(tfrecord.record(body))))
                rec.write(body)
        paths += names
    return paths, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, Servers(args.latency_ms, 0.0, 0.0) as servers:
        paths, where = write(Path(folder), args.records)
        upload(servers, "records", [(path.name, path) for path in paths])
        os.environ.update(servers.environment())
        url = f"s3://records/part-{{0..{FILES - 1}}}"
        ours = {
            ".tfrecord + index, shuffled": aioloader.TFRecord(url + ".tfrecord"),
            ".rec + .idx, shuffled": aioloader.RecordIO(
                [f"s3://records/part-{n}.rec" for n in range(FILES)],
                [f"s3://records/part-{n}.idx" for n in range(FILES)]),
        }
        rates: dict[str, float] = {}
        for order in (list(ours), list(reversed(ours))):  # whichever goes first starts up
            for name in order:
                loader = aioloader.Loader(ours[name], decode=first_byte, batch_size=BATCH,
                                          shuffle=True, num_workers=2, concurrency=256)
                rate = samples_per_second(loader, len(ours[name]), name)
                rates[name] = max(rates.get(name, 0.0), rate)
        import torch.utils.data

        sample = min(args.records, 640)  # one GET per record: slow enough to time on fewer
        theirs = RangedTFRecords(servers.endpoint, "records",
                                 [f"part-{n}.tfrecord" for n in range(FILES)], where[:sample])
        baseline = samples_per_second(
            torch.utils.data.DataLoader(theirs, batch_size=BATCH, shuffle=True, num_workers=2),
            sample, "DataLoader")
    print(f"{args.records} records of {RECORD // 1000} KB in {FILES} files on S3 (moto behind a "
          f"proxy, {args.latency_ms:g} ms per request), batch {BATCH}, shuffled, 2 processes")
    print(f"DataLoader, one ranged get_object per record   {baseline:8.0f} records/s  1.0x")
    for name, rate in rates.items():
        print(f"aioloader {name:<36} {rate:8.0f}            {rate / baseline:.1f}x")
    tf_rate, rec_rate = rates[".tfrecord + index, shuffled"], rates[".rec + .idx, shuffled"]
    print(f".tfrecord / .rec: {tf_rate / rec_rate:.2f}")


if __name__ == "__main__":
    main()
