"""`aioloader.from_torch`: a map-style PyTorch Dataset whose `__getitem__` runs in the decode
processes, on threads, giving the batches DataLoader gives."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest

import aioloader
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT, index_of

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402
from torch.utils.data import Dataset as TorchDataset  # noqa: E402

from aioloader.torch import TorchLoader  # noqa: E402


class Squares(TorchDataset):  # type: ignore[misc]
    """What a PyTorch user has: tensors, numbers and dicts from __getitem__."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> dict[str, object]:
        return {"x": torch.full((2, 3), float(index)), "y": index * index, "name": f"s{index}"}


class Downloads(TorchDataset):  # type: ignore[misc]
    """A blocking GET per item, as most DataLoader datasets for remote data do."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> int:
        import urllib.request

        with urllib.request.urlopen(self.urls[index], timeout=30) as response:
            return index_of(response.read())


class Broken(TorchDataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        if index == 6:
            raise KeyError("no sample six")
        return index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_equal_those_of_the_dataloader(num_workers: int) -> None:
    reference = list(DataLoader(Squares(), batch_size=8, shuffle=False))
    loader = aioloader.Loader(aioloader.from_torch(Squares(), io_threads=4), batch_size=8,
                              num_workers=num_workers)
    with TorchLoader(loader) as batches:
        got = list(batches)
    assert len(got) == len(reference)
    for mine, theirs in zip(got, reference, strict=True):
        assert torch.equal(mine["x"], theirs["x"]) and torch.equal(mine["y"], theirs["y"])
        assert mine["name"] == theirs["name"]


def test_getitem_reads_overlap_on_threads_in_the_decode_processes(
    faulty_server: TestServer,
) -> None:
    server = faulty_server
    server.set_faults(latency_ms=20)
    urls = [f"{server.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)]
    loader = aioloader.Loader(aioloader.from_torch(Downloads(urls), io_threads=8), batch_size=10,
                              num_workers=2)
    with loader:
        seen = [int(i) for batch in loader for i in batch]
    assert seen == list(range(SAMPLE_COUNT))
    assert server.stats()["max_in_flight"] > 2  # more than one read per process at once


def test_cheap_getitems_run_in_line_and_still_give_every_sample(server: TestServer) -> None:
    urls = [f"{server.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)]  # answers at once
    with aioloader.Loader(aioloader.from_torch(Downloads(urls)), batch_size=10) as loader:
        assert [int(i) for batch in loader for i in batch] == list(range(SAMPLE_COUNT))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_getitem_names_the_sample_and_keeps_its_type(num_workers: int) -> None:
    loader = aioloader.Loader(aioloader.from_torch(Broken()), batch_size=4,
                              num_workers=num_workers)
    with pytest.raises(aioloader.SampleError, match=r"sample 6 \(key 'Broken\[6\]'\).*six") as e:
        list(loader)
    assert isinstance(e.value, KeyError)  # as DataLoader re-raises it: `except KeyError` works
    loader.close()


def test_from_torch_refuses_what_is_neither_map_style_nor_iterable() -> None:
    with pytest.raises(TypeError, match=r"map-style .* or an IterableDataset"):
        aioloader.from_torch(42)
    with pytest.raises(ValueError, match="io_threads"):
        aioloader.from_torch(Squares(), io_threads=0)


def test_files_given_one_string_suggests_a_list() -> None:
    with pytest.raises(TypeError, match=r"Files\(\['a/path'\]\)"):
        aioloader.Files("a/path")  # type: ignore[arg-type]


def test_local_files_are_read_a_chunk_per_call(local_paths: list[str]) -> None:
    files = aioloader.Files(local_paths, labels=range(SAMPLE_COUNT))
    assert files.batched_fetch
    with aioloader.Loader(files, batch_size=16) as loader:
        raws, labels = zip(*[(r, lab) for b in loader for r, lab in zip(*b, strict=True)],
                           strict=True)
    assert [index_of(r) for r in raws] == list(range(SAMPLE_COUNT)) == [int(x) for x in labels]
    assert not aioloader.Files(["http://127.0.0.1:1/x.bin"]).batched_fetch
    assert np.asarray(labels).dtype.kind == "i"


class Tagged(TorchDataset):  # type: ignore[misc]
    """Tags each item with what both worker-info calls say, and whose copy of it answered."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, object]:
        ours, theirs = aioloader.get_worker_info(), torch.utils.data.get_worker_info()
        assert ours is not None and theirs is not None
        return {"index": index, "ours": ours.id, "theirs": theirs.id,
                "workers": theirs.num_workers, "mine": ours.dataset is self is theirs.dataset}


def test_both_worker_infos_answer_in_the_decode_processes_with_the_dataset_copy() -> None:
    with aioloader.Loader(aioloader.from_torch(Tagged()), batch_size=4, num_workers=2) as loader:
        batches = list(loader)
    ours = np.concatenate([b["ours"] for b in batches])
    assert (ours == np.concatenate([b["theirs"] for b in batches])).all()
    assert set(ours) <= {0, 1} and all((b["workers"] == 2).all() for b in batches)
    assert all(b["mine"].all() for b in batches)


def test_worker_info_is_read_only_as_dataloaders_is() -> None:
    info = aioloader.WorkerInfo(0, 2, 7, dataset=None)
    with pytest.raises(RuntimeError, match="cannot assign"):
        info.id = 1  # type: ignore[misc]


def test_tensors_that_numpy_cannot_hold_or_that_require_grad_collate() -> None:
    halves = [torch.full((2,), float(i), dtype=torch.bfloat16) for i in range(3)]
    stacked = aioloader.default_collate(halves)
    assert isinstance(stacked, torch.Tensor) and stacked.dtype == torch.bfloat16
    assert stacked.float().tolist() == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    grads = [torch.ones(2, requires_grad=True), torch.zeros(2, requires_grad=True)]
    assert aioloader.default_collate(grads).tolist() == [[1.0, 1.0], [0.0, 0.0]]


class Scaled(TorchDataset):  # type: ignore[misc]
    """A dataset its user changes between epochs: a factor set, items appended."""

    def __init__(self) -> None:
        self.items = [0, 1, 2, 3]
        self.scale = 1

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return self.items[index] * self.scale


@pytest.mark.parametrize("service", ["process", None])
def test_each_pass_takes_the_dataset_as_it_is_when_the_pass_starts(
    service: str | None
) -> None:
    """As each iter() of a DataLoader gives its workers the dataset as it is then: a change
    made after the loader was built, or between epochs, is seen, and len() agrees with the
    batches that come."""
    dataset = Scaled()
    loader = aioloader.Loader(aioloader.from_torch(dataset), batch_size=2, num_workers=2,
                              service=service)
    with loader:
        dataset.scale = 10  # after building
        assert [x for batch in loader for x in batch.tolist()] == [0, 10, 20, 30]
        dataset.items.append(4)
        assert len(loader) == 3
        batches = [batch.tolist() for batch in loader]
        assert batches == [[0, 10], [20, 30], [40]] and len(batches) == len(loader)
        dataset.scale = 100
        assert [x for batch in loader for x in batch.tolist()] == [0, 100, 200, 300, 400]


@pytest.mark.parametrize("service", ["process", None])
def test_persistent_workers_keep_the_dataset_of_the_first_pass(service: str | None) -> None:
    """DataLoader's persistent workers keep their copy: so do a persistent pool's."""
    dataset = Scaled()
    loader = aioloader.Loader(aioloader.from_torch(dataset), batch_size=2, num_workers=2,
                              service=service, persistent_workers=True)
    with loader:
        dataset.scale = 10  # before the first pass: seen
        assert [x for batch in loader for x in batch.tolist()] == [0, 10, 20, 30]
        dataset.scale = 100
        assert [x for batch in loader for x in batch.tolist()] == [0, 10, 20, 30]


class Shared(TorchDataset):  # type: ignore[misc]
    """A dataset whose workers share multiprocessing's objects, as DataLoader's inherit them:
    a counter under its lock, an array, a queue."""

    def __init__(self, size: int, context: str = "spawn") -> None:
        made = multiprocessing.get_context(context)
        self.calls, self.seen, self.pids = made.Value("i", 0), made.Array("b", size), made.Queue()
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        with self.calls.get_lock():
            self.calls.value += 1
        self.seen[index] = 1
        self.pids.put(os.getpid())
        return index


@pytest.mark.parametrize("service", ["process", None])
def test_multiprocessings_shared_objects_are_shared_with_the_decode_processes(
    service: str | None
) -> None:
    """What decode processes write to them, the trainer reads, and they to each other."""
    dataset = Shared(12)
    with aioloader.Loader(aioloader.from_torch(dataset), batch_size=4, num_workers=2,
                          service=service) as loader:
        assert sorted(x for batch in loader for x in batch.tolist()) == list(range(12))
        pids = {dataset.pids.get(timeout=10) for _ in range(12)}
    assert dataset.calls.value == 12 and list(dataset.seen) == [1] * 12
    assert os.getpid() not in pids


def test_a_lock_made_in_a_fork_context_is_refused_naming_the_context_to_use() -> None:
    """Its semaphore has no name left to open elsewhere: multiprocessing itself refuses it."""
    with pytest.raises(ValueError, match=r"get_context\('spawn'\)"):
        aioloader.Loader(aioloader.from_torch(Shared(4, "fork")), batch_size=2, num_workers=2,
                         service=None)


def test_epochs_cut_short_see_as_many_distinct_samples_as_dataloader() -> None:
    """`zip(range(20), loader)` five times, with shuffle and no set_epoch, as a loop that takes
    N steps per epoch does: each pass starts a new order, as each DataLoader iter() does (it
    used to start the same epoch over, and trained on the same 640 samples five times)."""
    dataset = list(range(3200))
    ours = aioloader.Loader(aioloader.from_torch(dataset), batch_size=32, shuffle=True,
                            num_workers=0)
    theirs = DataLoader(dataset, batch_size=32, shuffle=True)

    def distinct(loader: object) -> int:
        seen: set[int] = set()
        for _ in range(5):
            for _, batch in zip(range(20), loader, strict=False):  # type: ignore[call-overload]
                seen.update(int(i) for i in batch)
        return len(seen)

    with ours:
        got, expected = distinct(ours), distinct(theirs)
        assert ours.state_dict()["epoch"] == 5 and ours.state_dict()["position"] == 0
    assert abs(got - expected) < 0.05 * expected, (got, expected)  # about 2150 each
