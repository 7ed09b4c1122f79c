"""The loader's own cost: an in-memory dataset with a trivial decode, against PyTorch's
DataLoader; and the per-batch cost of handing a 64x3x224x224 float32 batch back from a decode
process by pickle and by shared memory. All figures from this one run.

The in-memory data is brought to aioloader the three ways a user would: an aioloader Dataset
with `fetch` (a task per sample in the event loop), the same with `fetch_many` and
`batched_fetch = True` (a call per batch), and the PyTorch-style object itself through
`aioloader.from_torch` (its `__getitem__` runs in the decode processes, as in DataLoader).

    python benchmarks/overhead.py
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from benchmarks_common import Indices, samples_per_second

import aioloader

SAMPLES = 64 * 1600
"""About a second per epoch: at 25,600 samples an epoch lasted 0.15 s and the ratios moved
from 1.05x to 1.90x between runs."""
BATCH = 64


class InMemory(Indices):
    """Also a map-style dataset for PyTorch (len and getitem)."""

    def __getitem__(self, index: int) -> int:
        return index


class InMemoryBatched(InMemory):
    """What the docs suggest for data in memory: a call per batch instead of a task per
    sample."""

    batched_fetch = True

    async def fetch_many(self, indices: Sequence[int]) -> list[int]:
        return list(indices)


def trivial(index: int) -> int:
    return index


def image_sized(index: int) -> np.ndarray:
    return np.full((3, 224, 224), index % 7, np.float32)


def aioloader_rate(
    decode: Any, samples: int, shared_memory: bool = True, dataset: Any = None
) -> float:
    loader = aioloader.Loader(dataset or InMemory(samples), decode=decode, batch_size=BATCH,
                              num_workers=2, persistent_workers=True, shared_memory=shared_memory)
    with loader:
        samples_per_second(loader, samples, "warm-up")
        return samples_per_second(loader, samples, "aioloader")


def torch_rate(samples: int) -> float:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(InMemory(samples), batch_size=BATCH, num_workers=2,
                                         persistent_workers=True)
    samples_per_second(loader, samples, "warm-up")
    return samples_per_second(loader, samples, "DataLoader")


def main() -> None:
    ours, theirs = aioloader_rate(trivial, SAMPLES), torch_rate(SAMPLES)
    batched = aioloader_rate(trivial, SAMPLES, dataset=InMemoryBatched(SAMPLES))
    from_torch = aioloader_rate(None, SAMPLES, dataset=aioloader.from_torch(InMemory(SAMPLES)))
    one_thread = aioloader_rate(None, SAMPLES,
                                dataset=aioloader.from_torch(InMemory(SAMPLES), io_threads=1))
    images = 64 * 30
    pickled = aioloader_rate(image_sized, images, shared_memory=False)
    shared = aioloader_rate(image_sized, images, shared_memory=True)
    batch = np.zeros((BATCH, 3, 224, 224), np.float32)
    import pickle

    started = time.perf_counter()
    for _ in range(10):
        pickle.loads(pickle.dumps(batch, protocol=5))
    pickle_copy = (time.perf_counter() - started) / 10

    print(f"\nin-memory dataset, trivial decode, batch {BATCH}, 2 decode processes, warm "
          "(second epoch):")
    print(f"  {'PyTorch DataLoader':<44} {theirs:9.0f} samples/s")
    for name, rate in [("aioloader, fetch (a task per sample)", ours),
                       ("aioloader, fetch_many (a call a batch)", batched),
                       ("aioloader, from_torch(the same object)", from_torch),
                       ("  the same, io_threads=1 (no I/O to overlap)", one_thread)]:
        print(f"  {name:<44} {rate:9.0f} samples/s   {rate / theirs:.2f}x DataLoader")
    print(f"batches of {BATCH}x3x224x224 float32 ({batch.nbytes / 1e6:.0f} MB) from the decode "
          "processes (decode makes a constant array):")
    print(f"  pickled through the pipe  {pickled / BATCH:6.1f} batches/s = "
          f"{1e3 * BATCH / pickled:6.1f} ms per batch")
    print(f"  shared memory             {shared / BATCH:6.1f} batches/s = "
          f"{1e3 * BATCH / shared:6.1f} ms per batch")
    print(f"  (pickle.dumps + loads alone, in one process: {1e3 * pickle_copy:.1f} ms per batch)")


if __name__ == "__main__":
    main()
