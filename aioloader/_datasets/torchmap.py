"""`from_torch`: a map-style PyTorch Dataset (or anything with `__len__` and `__getitem__`) as a
source for the Loader, its `__getitem__` run in the decode processes on threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .base import Dataset


class FromTorch(Dataset):
    """Sends only indices from the event loop; each decode process calls `__getitem__` on
    `io_threads` threads, so `num_workers * io_threads` items are in flight: the blocking
    reads of a usual `__getitem__` (open, requests, boto3) overlap as aioloader's own reads do.
    """

    batched_fetch = True

    def __init__(self, dataset: Any, io_threads: int = 16) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(
                "from_torch takes a map-style dataset (__len__ and __getitem__), got "
                f"{type(dataset).__name__}; for an IterableDataset write an aioloader.Stream"
            )
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an integer >= 1, got {io_threads!r}")
        self.dataset = dataset
        self.io_threads = io_threads

    def __len__(self) -> int:
        return len(self.dataset)

    def key(self, index: int) -> str:
        return f"{type(self.dataset).__name__}[{index}]"

    async def fetch(self, index: int) -> int:
        return index

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        return list(indices)

    def load_in_workers(self) -> tuple[Callable[[Any], Any], int]:
        return self.dataset.__getitem__, self.io_threads


def from_torch(dataset: Any, io_threads: int = 16) -> FromTorch:
    """A map-style `torch.utils.data.Dataset` as a source for `aioloader.Loader`.

    `__getitem__` runs in the decode processes, `io_threads` at a time in each, so blocking
    reads overlap; batches equal those of `DataLoader(dataset, batch_size=..., shuffle=False)`
    (as numpy arrays; `aioloader.torch.TorchLoader` gives tensors). The dataset travels to
    the decode processes by value, once per process.
    """
    return FromTorch(dataset, io_threads)
