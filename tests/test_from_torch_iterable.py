"""`aioloader.from_torch` with an IterableDataset: a copy iterated in each decode process, as in
DataLoader's workers, with the batches, order and errors DataLoader gives."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from typing import Any

import pytest

import aioloader

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, IterableDataset, get_worker_info  # noqa: E402

from aioloader.torch import TorchLoader  # noqa: E402


class Counting(IterableDataset):  # type: ignore[misc]
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class PerWorker(IterableDataset):  # type: ignore[misc]
    """Worker w yields range(sizes[w]): workers that run out at different times."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Any:
        info = get_worker_info()
        assert info is not None and info.dataset is self  # the copy this worker iterates
        return iter(range(self.sizes[info.id]))


class Sharded(IterableDataset):  # type: ignore[misc]
    """Reads only its worker's share, as a dataset written for DataLoader does."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class Resumable(IterableDataset):  # type: ignore[misc]
    """`Sharded` with torchdata's Stateful protocol (where its iterator stands), counting the
    items it makes in a counter its copies share: a copy resumed from its state makes none
    twice."""

    def __init__(self, n: int) -> None:
        self.n, self.next = n, -1
        self.made = multiprocessing.get_context("spawn").Value("i", 0)

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        first, self.next = (self.next if self.next >= 0 else start), -1
        for i in range(first, self.n, step):
            self.next = i + step
            with self.made.get_lock():
                self.made.value += 1
            yield i
        self.next = -1  # run out: the next iteration starts anew

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


class Failing(IterableDataset):  # type: ignore[misc]
    def __iter__(self) -> Any:
        raise RuntimeError("Error in __iter__")


class DiesAtFive(IterableDataset):  # type: ignore[misc]
    def __iter__(self) -> Any:
        for i in range(20):
            if i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            yield i


def loader(dataset: Any, **options: Any) -> aioloader.Loader:
    return aioloader.Loader(aioloader.from_torch(dataset), **options)


def plain(batches: Any) -> list[Any]:
    return [b.tolist() if hasattr(b, "tolist") else b for b in batches]


def test_items_come_as_from_dataloader_in_one_process() -> None:
    with loader(Counting(20), batch_size=None, num_workers=0) as items:
        got = list(items)
        assert got == list(range(20)) and all(type(i) is int for i in got)
        assert len(items) == 20
    with loader(Counting(20), batch_size=7, num_workers=0) as batches:
        assert plain(batches) == [list(range(7)), list(range(7, 14)), list(range(14, 20))]
        assert len(batches) == 3
    with loader(Counting(20), batch_size=7, drop_last=True, num_workers=0) as batches:
        assert plain(batches) == [list(range(7)), list(range(7, 14))]


@pytest.mark.parametrize("service", [None, "process"])
def test_each_worker_iterates_its_own_copy_in_dataloaders_order(service: str | None) -> None:
    dataset = Sharded(50)
    theirs = [b.tolist() for b in DataLoader(dataset, batch_size=4, num_workers=2)]
    with loader(dataset, batch_size=4, num_workers=2, service=service) as ours:
        for _ in range(2):  # and again, each pass iterating anew
            assert plain(ours) == theirs
    with loader(PerWorker([0, 4, 20]), batch_size=7, num_workers=3, service=service) as ours:
        assert sorted(map(tuple, plain(ours))) == sorted(
            [tuple(range(4)), tuple(range(7)), tuple(range(7, 14)), tuple(range(14, 20))])
    with loader(PerWorker([0, 4, 20]), batch_size=7, num_workers=3, drop_last=True,
                service=service) as ours:
        assert sorted(map(tuple, plain(ours))) == [tuple(range(7)), tuple(range(7, 14))]
    with loader(PerWorker([0, 4, 20]), batch_size=None, num_workers=3,
                service=service) as ours:
        assert sorted(ours) == sorted([*range(4), *range(20)])


def test_tensors_come_from_a_torchloader() -> None:
    with TorchLoader(loader(Sharded(10), batch_size=5, num_workers=2)) as batches:
        got = list(batches)
    assert all(isinstance(b, torch.Tensor) for b in got)
    assert sorted(int(i) for b in got for i in b) == list(range(10))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_in_iter_reaches_the_caller_with_its_type(num_workers: int) -> None:
    with loader(Failing(), batch_size=2, num_workers=num_workers) as failing, \
            pytest.raises(RuntimeError, match="Error in __iter__"):
        list(failing)


def test_a_worker_that_dies_ends_the_pass_rather_than_repeat_items() -> None:
    with loader(DiesAtFive(), batch_size=2, num_workers=2) as dying, \
            pytest.raises(aioloader.WorkerDiedError, match="IterableDataset"):
        list(dying)


def test_what_does_not_apply_is_refused_naming_why() -> None:
    with pytest.raises(ValueError, match="shuffle"):
        loader(Counting(4), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="service='process' or None"):
        loader(Counting(4), batch_size=2, num_workers=1, service="node")
    with loader(Counting(8), batch_size=2, num_workers=2) as items:
        for n, _ in enumerate(items):
            if n == 1:
                state = items.state_dict()
                break
    with pytest.raises(aioloader.LoaderError, match="saved with 2 decode processes"):
        loader(Counting(8), batch_size=2, num_workers=3).load_state_dict(state)
    del state["copies"]  # as an older version saved it
    with pytest.raises(aioloader.LoaderError, match="epoch's start"):
        loader(Counting(8), batch_size=2, num_workers=2).load_state_dict(state)


def first_batches_then_state(made: aioloader.Loader, steps: int) -> tuple[list[int], Any]:
    """The items of `steps` batches, and the state saved inside the loop before the break."""
    taken: list[int] = []
    for n, batch in enumerate(made):
        taken += batch.tolist()
        if n == steps - 1:
            return taken, json.loads(json.dumps(made.state_dict()))
    raise AssertionError("the pass ended first")


@pytest.mark.parametrize(("num_workers", "service"), [(2, None), (2, "process"), (0, None)])
@pytest.mark.parametrize("stateful", [True, False], ids=["state_dict", "skipping"])
def test_a_pass_resumed_mid_epoch_continues_each_copy_where_it_stood(
    num_workers: int, service: str | None, stateful: bool
) -> None:
    """As torchdata's StatefulDataLoader: each worker's copy loads its state where it offers
    one (and makes no item twice), else skips the items it had given; the turns go on where
    they were, so the items come in the order of one unbroken pass, then the next epoch is
    whole."""
    def made() -> Any:
        return Resumable(41) if stateful else Sharded(41)

    options = {"batch_size": 3, "num_workers": num_workers, "service": service}
    with loader(made(), **options) as whole:
        unbroken = [x for batch in whole for x in batch.tolist()]
    with loader(made(), **options) as first:
        taken, state = first_batches_then_state(first, 5)
    resumed = made()
    with loader(resumed, **options) as again:
        again.load_state_dict(state)
        rest = [x for batch in again for x in batch.tolist()]
        assert taken + rest == unbroken
        if stateful:
            assert resumed.made.value == 41 - 15
        assert sorted(x for batch in again for x in batch.tolist()) == list(range(41))


def test_a_copy_that_had_run_out_stays_out_when_resumed() -> None:
    def made() -> aioloader.Loader:
        return loader(PerWorker([2, 20]), batch_size=3, num_workers=2)

    with made() as whole:
        unbroken = [x for batch in whole for x in batch.tolist()]
    with made() as first:
        taken, state = first_batches_then_state(first, 4)
    assert [copy["exhausted"] for copy in state["copies"]["workers"]] == [True, False]
    with made() as again:
        again.load_state_dict(state)
        assert taken + [x for batch in again for x in batch.tolist()] == unbroken


TORCHRUN_JOB = '''
import json, os, sys
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, get_worker_info
import aioloader
from aioloader.torch import TorchLoader


class RankAndWorkerShards(IterableDataset):
    """What a streaming dataset written for DataLoader does: its rank's share (from the
    environment torchrun sets), then its worker's share of that."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(rank * workers + worker, self.n, world * workers))


def new_loader():
    return aioloader.Loader(aioloader.from_torch(RankAndWorkerShards(100)), batch_size=5,
                            num_workers=2, service=None if sys.argv[2] == "None" else sys.argv[2])


def step(batch):
    optimizer.zero_grad()
    model(batch.float().unsqueeze(1)).sum().backward()  # all-reduces every step
    optimizer.step()
    return batch.tolist()


dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = new_loader()
seen = []
with TorchLoader(loader) as batches:
    for epoch in range(2):
        loader.set_epoch(epoch)
        items = []
        for batch in batches:
            items += step(batch)
        seen.append(items)
    loader.set_epoch(2)  # the job stops after 3 steps of epoch 2, saving its state
    items = []
    for n, batch in enumerate(batches):
        items += step(batch)
        if n == 2:
            state = json.loads(json.dumps(loader.state_dict()))
            break
resumed = new_loader()  # the job restarted
resumed.load_state_dict(state)
with TorchLoader(resumed) as batches:
    for batch in batches:
        items += step(batch)
seen.append(items)
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as out:
    json.dump(seen, out)
dist.destroy_process_group()
'''


@pytest.mark.parametrize("service", ["process"])  # in the trainer's process: above, alone
def test_under_torchrun_two_ranks_of_two_workers_read_every_item_once_per_epoch_and_resume(
    tmp_path: Any, service: str
) -> None:
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(tmp_path), service], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for epoch in range(3):  # the last one stopped after 3 steps and resumed
        items = ranks[0][epoch] + ranks[1][epoch]
        assert sorted(items) == list(range(100)), f"epoch {epoch}"
