"""`from_torch`: a PyTorch Dataset as a source for the Loader. A map-style one (or anything with
`__len__` and `__getitem__`) has its `__getitem__` run in the decode processes; an
IterableDataset is iterated there, a copy per process (`torchiter`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from .base import Dataset
from .torchiter import FromTorchIterable


class FromTorch(Dataset):
    """Sends only indices from the event loop; each decode process calls `__getitem__` on its
    copy of the dataset, on `io_threads` threads at once, so `num_workers * io_threads` items
    are in flight."""

    batched_fetch = True

    def __init__(self, dataset: Any, io_threads: int = 1) -> None:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(
                "from_torch takes a map-style dataset (__len__ and __getitem__) or an "
                f"IterableDataset (__iter__), got {type(dataset).__name__}"
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

    def load(self, index: int) -> Any:
        """The sample, in a decode process, from its copy (`self.dataset`, which
        `get_worker_info().dataset` is there)."""
        return self.dataset[index]

    def load_in_workers(self) -> tuple[Callable[[Any], Any], int]:
        return self.load, self.io_threads


def from_torch(dataset: Any, io_threads: int = 1) -> FromTorch | FromTorchIterable:
    """A `torch.utils.data.Dataset` as a source for `aioloader.Loader`.

    An `IterableDataset` is iterated in the decode processes, a copy in each, as DataLoader's
    workers do: `torch.utils.data.get_worker_info()` there gives the process's id among
    `num_workers`, so a dataset that shards by it reads every item once, and batches come
    worker by worker in turn (DataLoader's order). It is iterated anew at each pass; it is not
    shuffled, divided among ranks or resumed mid-epoch by the loader (it does that itself, as
    with DataLoader). `io_threads` does not apply to it.

    `__getitem__` runs in the decode processes; batches equal those of
    `DataLoader(dataset, batch_size=..., shuffle=False)` (as numpy arrays;
    `aioloader.torch.TorchLoader` gives tensors). The dataset travels to each decode process by
    value, once, so each has its own copy, as each DataLoader worker has.

    By default each copy sees one `__getitem__` at a time, as in a DataLoader worker, so a
    dataset written for DataLoader (one file handle: seek, then read) gives the right samples.
    `io_threads=N` runs N calls at once on the same copy, so that blocking reads (open,
    requests, boto3) overlap, `num_workers * N` in flight: pass it when `__getitem__` is
    thread-safe (it keeps no state shared between calls, or guards it with a lock).

    Why not a copy of the dataset per thread, which would make any `__getitem__` safe on
    threads: the datasets that wait on I/O are the ones that hold an index of every sample
    (paths, URLs, labels: hundreds of MB for ImageNet), and a copy per thread of each process
    would multiply that memory by `io_threads`.
    """
    if _iterable(dataset):
        return FromTorchIterable(dataset)
    return FromTorch(dataset, io_threads)


def _iterable(dataset: Any) -> bool:
    """An IterableDataset (torch's, an IterDataPipe), or anything iterable that cannot be
    indexed. torch's IterableDataset inherits a `__getitem__` that raises, so it is asked by
    type when torch is loaded."""
    torch_data = sys.modules.get("torch.utils.data")
    if torch_data is not None and isinstance(dataset, torch_data.IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")
