"""Bringing an existing PyTorch Dataset: `aioloader.from_torch` against PyTorch's DataLoader on
the same Dataset, whose `__getitem__` does a blocking `requests` GET.

2,000 objects of 16 KiB on the project's test server (127.0.0.1, 20 ms per request), batch
64, 2 processes each: DataLoader workers, or aioloader decode processes each running
`__getitem__` on `io_threads` threads. The Dataset is the same class for both
(`benchmarks_common.RequestsDataset`: one keep-alive session per process). Figures from this
one run.

    python benchmarks/from_torch.py [--objects 2000] [--io-threads 16]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks_common import RequestsDataset, samples_per_second
from remote_latency import BATCH, torch_rate, trivial_decode, write_objects

import aioloader
from aioloader.testing import TestServer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--io-threads", type=int, default=16)
    parser.add_argument("--torch-objects", type=int, default=640,
                        help="objects the (slow) DataLoader reads; rate is per second anyway")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        names = write_objects(Path(folder), args.objects)
        with TestServer(folder, latency_ms=args.latency_ms) as server:
            urls = [server.url + n for n in names]
            dataset = RequestsDataset(urls, trivial_decode)
            loader = aioloader.Loader(
                aioloader.from_torch(dataset, io_threads=args.io_threads), batch_size=BATCH,
                num_workers=2, persistent_workers=True,
            )
            with loader:
                samples_per_second(loader, len(urls), "from_torch warm-up")
                ours = samples_per_second(loader, len(urls), "from_torch")
            theirs = torch_rate(urls[: args.torch_objects], 2)
    print(f"\n{args.objects} objects x 16 KiB over HTTP, {args.latency_ms:g} ms latency, the same "
          f"Dataset (requests GET in __getitem__), batch {BATCH}, 2 processes")
    print(f"  aioloader.from_torch, io_threads={args.io_threads}  {ours:7.0f} samples/s")
    print(f"  PyTorch DataLoader, 2 workers         {theirs:7.0f} samples/s")
    print(f"  ratio {ours / theirs:.1f}x (goal >= 10x)")


if __name__ == "__main__":
    main()
