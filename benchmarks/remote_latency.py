"""Remote reads with 20 ms latency: aioloader against PyTorch's DataLoader and bare aiohttp.

10,000 objects of 16 KiB on the project's test server (127.0.0.1, 20 ms per request), a trivial
decode (bytes to a uint8 array), batch 64. Every figure comes from this one run; the printed
ratios are what to compare across machines.

    python benchmarks/remote_latency.py [--objects 10000] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import numpy.typing as npt
from benchmarks_common import RequestsDataset, samples_per_second
from tqdm import tqdm

import aioloader
from aioloader.testing import TestServer

OBJECT_SIZE = 16 * 1024
BATCH = 64


def trivial_decode(raw: bytes) -> npt.NDArray[np.uint8]:
    return np.frombuffer(raw, dtype=np.uint8)


def write_objects(folder: Path, count: int) -> list[str]:
    names = []
    for i in tqdm(range(count), desc="writing objects", leave=False):
        name = f"{i:06d}.bin"
        (folder / name).write_bytes(np.random.default_rng(i).bytes(OBJECT_SIZE))
        names.append(name)
    return names


async def bare_aiohttp(urls: list[str], concurrency: int) -> float:
    """The ceiling: one session, `concurrency` GETs in flight, nothing else."""
    slots = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def get(url: str) -> int:
            async with slots, session.get(url) as response:
                return len(await response.read())

        started = time.perf_counter()
        sizes = await asyncio.gather(*(get(u) for u in urls))
        elapsed = time.perf_counter() - started
    assert sum(sizes) == len(urls) * OBJECT_SIZE
    return len(urls) / elapsed


def aioloader_rates(urls: list[str], concurrency: int, num_workers: int) -> tuple[float, float]:
    """Two epochs: the first pays the one-time start of the zygote and the decode
    processes, the second does not."""
    loader = aioloader.Loader(
        aioloader.Files(urls), decode=trivial_decode, batch_size=BATCH,
        concurrency=concurrency, num_workers=num_workers,
    )
    with loader:
        cold = samples_per_second(loader, len(urls), "aioloader epoch 1")
        warm = samples_per_second(loader, len(urls), "aioloader epoch 2")
    return cold, warm


def torch_rate(urls: list[str], num_workers: int) -> float:
    """PyTorch's DataLoader over a map-style Dataset doing one `requests` GET per item."""
    import torch.utils.data

    dataset = RequestsDataset(urls, trivial_decode)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=num_workers)
    return samples_per_second(loader, len(urls), f"DataLoader x{num_workers}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--torch-objects", type=int, default=1_280,
                        help="objects the (slow) DataLoader runs read; rate is per second anyway")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as folder:
        names = write_objects(Path(folder), args.objects)
        with TestServer(folder, latency_ms=args.latency_ms) as server:
            urls = [server.url + n for n in names]
            bare = asyncio.run(bare_aiohttp(urls, args.concurrency))
            cold, warm = aioloader_rates(urls, args.concurrency, 2)
            torch2 = torch_rate(urls[: args.torch_objects], 2)
            torch8 = torch_rate(urls[: args.torch_objects * 4], 8)
    ours = f"aioloader, {args.concurrency} in flight, 2 decode processes"
    print(f"\n{args.objects} objects x 16 KiB, {args.latency_ms:g} ms latency, batch {BATCH}, "
          "trivial decode (bytes -> uint8 array); test server on 127.0.0.1")
    for name, rate in [
        (f"bare aiohttp, {args.concurrency} in flight", bare),
        (f"{ours}, epoch 1 (cold start)", cold),
        (f"{ours}, epoch 2", warm),
        ("PyTorch DataLoader, 2 workers, requests", torch2),
        ("PyTorch DataLoader, 8 workers, requests", torch8),
    ]:
        print(f"  {name:<62} {rate:7.0f} samples/s")
    print("  ratios (epoch 1 / epoch 2):")
    print(f"    aioloader / DataLoader x2:  {cold / torch2:5.1f}x / {warm / torch2:5.1f}x"
          "  (goal >= 50x)")
    print(f"    aioloader / DataLoader x8:  {cold / torch8:5.1f}x / {warm / torch8:5.1f}x")
    print(f"    aioloader / bare aiohttp:   {cold / bare:5.0%} / {warm / bare:5.0%}  (goal >= 80%)")


if __name__ == "__main__":
    main()
