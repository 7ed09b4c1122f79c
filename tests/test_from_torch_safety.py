"""`from_torch` with what PyTorch datasets commonly do: a `__getitem__` that is not thread-safe
(one file handle: seek, then read), and tensors that are small views of one big tensor."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset as TorchDataset  # noqa: E402

RECORD = 1024
RECORDS = 96


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Record i: RECORD bytes of value i % 256."""
    path = tmp_path_factory.mktemp("records") / "records.bin"
    path.write_bytes(b"".join(bytes([i % 256]) * RECORD for i in range(RECORDS)))
    return path


class SeekThenRead(TorchDataset):  # type: ignore[misc]
    """One file handle per copy of the dataset, opened lazily as usual for DataLoader workers:
    right when calls come one at a time, wrong when two threads share the handle. The pause
    stands for a slow disk between the seek and the read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: Any = None

    def __len__(self) -> int:
        return RECORDS

    def __getitem__(self, index: int) -> np.ndarray:
        if self.file is None:
            self.file = open(self.path, "rb")  # noqa: SIM115 - held for the dataset's life
        self.file.seek(index * RECORD)
        time.sleep(0.002)
        return np.frombuffer(self.file.read(RECORD), np.uint8)


class ThreadSafe(TorchDataset):  # type: ignore[misc]
    """Positional reads (`os.pread`) are thread-safe; returns how many calls were running
    at once when it ran."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.running = 0
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def __len__(self) -> int:
        return RECORDS

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        with self.lock:
            self.running += 1
            at_once = self.running
        try:
            descriptor = os.open(self.path, os.O_RDONLY)
            try:
                time.sleep(0.005)
                record = os.pread(descriptor, RECORD, index * RECORD)
            finally:
                os.close(descriptor)
            with self.lock:
                return np.frombuffer(record, np.uint8), max(at_once, self.running)
        finally:
            with self.lock:
                self.running -= 1


def values(batches: list[Any]) -> list[int]:
    return [int(record[0]) for batch in batches for record in batch if (record == record[0]).all()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_getitem_that_is_not_thread_safe_gives_every_sample_right_by_default(
    records: Path, num_workers: int
) -> None:
    loader = aioloader.Loader(aioloader.from_torch(SeekThenRead(records)), batch_size=8,
                              num_workers=num_workers)
    with loader:
        got = values(list(loader))
    assert got == [i % 256 for i in range(RECORDS)]


def test_a_thread_safe_getitem_still_runs_on_threads_when_asked(records: Path) -> None:
    loader = aioloader.Loader(aioloader.from_torch(ThreadSafe(records), io_threads=8),
                              batch_size=16, num_workers=2)
    with loader:
        batches = list(loader)
    assert values([batch[0] for batch in batches]) == [i % 256 for i in range(RECORDS)]
    assert max(int(n) for batch in batches for n in batch[1]) > 1


class Views(TorchDataset):  # type: ignore[misc]
    """Each item a 1 KiB view of one 64 MiB tensor, as slicing a preloaded tensor gives."""

    def __init__(self) -> None:
        self.big = torch.arange(16 * 2**20, dtype=torch.float32)

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> Any:
        return {"x": self.big[index * 256 : (index + 1) * 256], "label": index}


def test_tensor_views_travel_as_their_own_elements_not_their_whole_storage() -> None:
    loader = aioloader.Loader(aioloader.from_torch(Views()), batch_size=None, num_workers=2)
    with loader:
        samples = list(loader)
    assert len(samples) == 32
    for index, sample in enumerate(samples):
        x = sample["x"]
        assert torch.equal(x, torch.arange(index * 256, (index + 1) * 256, dtype=torch.float32))
        travelled = x.untyped_storage().nbytes()
        assert travelled == 256 * 4  # not the 64 MiB it was cut from


class ViewsRead(aioloader.Dataset):
    """Raw items that are 1 KiB views of one 64 MiB tensor, decoded in the decode processes."""

    def __init__(self) -> None:
        self.big = torch.arange(16 * 2**20, dtype=torch.float32)

    def __len__(self) -> int:
        return 8

    async def fetch(self, index: int) -> Any:
        return self.big[index * 256 : (index + 1) * 256]


def storage_and_first(raw: Any) -> tuple[int, float]:
    """The bytes of storage the raw item arrived with, and its first value."""
    return raw.untyped_storage().nbytes(), float(raw[0])


def test_raw_tensor_views_reach_the_decode_processes_as_their_own_elements() -> None:
    loader = aioloader.Loader(ViewsRead(), decode=storage_and_first, batch_size=None,
                              num_workers=2)
    with loader:
        got = [(int(travelled), float(first)) for travelled, first in loader]
    assert got == [(256 * 4, float(index * 256)) for index in range(8)]
