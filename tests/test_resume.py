"""Resuming mid-epoch: the same batches as an uninterrupted run, whatever the workers, and
elastic resumption on another number of ranks with nothing skipped."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioloader
from aioloader import recordio

from decoders import index_and_noise

SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def batches_of(loader: aioloader.Loader, limit: int | None = None,
               saved: list[dict[str, Any]] | None = None) -> list[list[float]]:
    """Each batch as a list of (index, first noise value) pairs, flattened; after `limit`
    batches, the state is put in `saved`, taken inside the loop as a resumable job does."""
    out = []
    for batch in loader:
        out.append(np.column_stack([batch["index"], batch["noise"][:, 0]]).ravel().tolist())
        if limit is not None and len(out) == limit:
            if saved is not None:
                saved.append(json.loads(json.dumps(loader.state_dict())))
            break
    return out


@SETTINGS
@given(
    break_at=st.integers(1, 12),
    workers=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    concurrency=st.sampled_from([1, 7, 64]),
    shuffle=st.booleans(),
)
def test_resumed_batches_equal_the_uninterrupted_run(
    local_paths: list[str], break_at: int, workers: tuple[int, int], concurrency: int,
    shuffle: bool,
) -> None:
    def make(num_workers: int) -> aioloader.Loader:
        loader = aioloader.Loader(
            aioloader.Files(local_paths), decode=index_and_noise, batch_size=8, shuffle=shuffle,
            seed=11, num_workers=num_workers, concurrency=concurrency,
        )
        loader.set_epoch(3)
        return loader

    uninterrupted = batches_of(make(0))
    with make(workers[0]) as first:
        saved: list[dict[str, Any]] = []
        taken = batches_of(first, limit=break_at, saved=saved)
        state = saved[0]
    with make(workers[1]) as second:
        second.load_state_dict(state)
        assert taken + batches_of(second) == uninterrupted


def write_rec(path: Path, count: int) -> None:
    with recordio.Writer(path, path.with_suffix(".idx")) as writer:
        for i in range(count):
            writer.write(i.to_bytes(4, "little") + bytes(i % 13))


def record_index(record: bytes, rng: np.random.Generator) -> dict[str, object]:
    return {"index": int.from_bytes(record[:4], "little"), "noise": rng.random(1)}


@SETTINGS
@given(break_at=st.integers(1, 9), workers=st.integers(0, 2))
def test_recordio_resumes_exactly(tmp_path_factory: object, break_at: int, workers: int) -> None:
    folder = Path(str(tmp_path_factory.mktemp("rec")))  # type: ignore[attr-defined]
    write_rec(folder / "r.rec", 70)

    def make(num_workers: int) -> aioloader.Loader:
        dataset = aioloader.RecordIO(str(folder / "r.rec"), str(folder / "r.idx"))
        return aioloader.Loader(dataset, decode=record_index, batch_size=6, shuffle=True,
                                num_workers=num_workers)

    uninterrupted = batches_of(make(0))
    with make(workers) as first:
        saved: list[dict[str, Any]] = []
        taken = batches_of(first, limit=break_at, saved=saved)
        state = saved[0]
    with make(0) as second:
        second.load_state_dict(state)
        assert taken + batches_of(second) == uninterrupted


def indices_in_lockstep(loaders: list[aioloader.Loader], steps: int | None,
                        saved: list[dict[str, Any]] | None = None) -> list[int]:
    """Step all ranks together, as distributed training does; the indices they took. Every
    rank's state after the last step goes in `saved`, taken before the passes close."""
    seen = []
    iterators = [iter(loader) for loader in loaders]
    step = 0
    while steps is None or step < steps:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks ran out at different steps"
        seen += [int(i) for b in batches for i in b["index"]]
        step += 1
    if saved is not None:
        saved += [loader.state_dict() for loader in loaders]
    for it in iterators:
        it.close()  # type: ignore[attr-defined]
    return seen


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    length=st.integers(30, 100),
    batch_size=st.integers(1, 9),
    before=st.sampled_from([1, 2, 3, 4]),
    after=st.sampled_from([1, 2, 3]),
    steps=st.integers(0, 6),
)
def test_elastic_resume_on_another_world_size_skips_nothing(
    local_paths: list[str], length: int, batch_size: int, before: int, after: int, steps: int
) -> None:
    paths = local_paths[:length]  # sample i holds index i

    def ranks(world_size: int) -> list[aioloader.Loader]:
        return [
            aioloader.Loader(aioloader.Files(paths), decode=index_and_noise,
                             batch_size=batch_size, shuffle=True, seed=5, num_workers=0,
                             rank=r, world_size=world_size)
            for r in range(world_size)
        ]

    first = ranks(before)
    steps = min(steps, len(first[0]) - 1)  # break off before the epoch ends
    states: list[dict[str, Any]] = []
    taken = indices_in_lockstep(first, steps, states)
    state = states[-1]  # any rank's state resumes every rank
    assert all(saved == state for saved in states)
    second = ranks(after)
    for loader in second:
        loader.load_state_dict(state)
    rest = indices_in_lockstep(second, None)
    order = taken + rest
    assert set(order) == set(range(length))
    # repeats come only from padding to a multiple of the world size (at most world_size - 1
    # each time the epoch is cut into shares)
    assert len(order) - length <= (before - 1) + (after - 1)
    if length % before == 0 and (length - state["position"]) % after == 0:
        assert sorted(order) == list(range(length))  # nothing to pad: nothing twice


def saved_after(loader: aioloader.Loader, batches: int) -> dict[str, object]:
    """The loader's state after `batches` batches, as it will be stored: through JSON."""
    for taken, _ in enumerate(loader, 1):
        if taken == batches:
            return dict(json.loads(json.dumps(loader.state_dict())))
    raise AssertionError(f"the epoch ended before {batches} batches")


def test_a_state_of_another_dataset_with_a_file_fewer_is_refused_naming_what_differs(
    local_paths: list[str],
) -> None:
    """A position means a sample only in the data it was saved for: in a list a file
    shorter, it would resume other samples, silently."""

    def make(paths: list[str]) -> aioloader.Loader:
        return aioloader.Loader(aioloader.Files(paths), decode=index_and_noise, batch_size=8,
                                shuffle=True, num_workers=0)

    state = saved_after(make(local_paths), 2)
    fewer = make(local_paths[:-1])
    count = len(local_paths)
    with pytest.raises(aioloader.LoaderError,
                       match=rf"saved for other data: length {count}, now {count - 1}; urls "):
        fewer.load_state_dict(state)
    with pytest.raises(aioloader.LoaderError, match=r"saved for other data: urls [0-9a-f]{16}, "):
        make(local_paths[::-1]).load_state_dict(state)  # the same files in another order
    make(local_paths).load_state_dict(state)
    del state["dataset"]  # as an older version saved it: nothing to check against
    fewer.load_state_dict(state)


def write_tar(path: Path, first: int, count: int) -> str:
    with tarfile.open(path, "w") as tar:
        for i in range(first, first + count):
            info = tarfile.TarInfo(f"{i:05d}.txt")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"%04d" % i))
    return str(path)


def test_a_tar_state_resumed_over_the_shards_in_another_order_is_refused(
    tmp_path: Path,
) -> None:
    """The epoch's sequence comes from the shards' sample counts in order: shards listed
    otherwise (a glob sorted differently) give other samples at the same positions."""
    shards = [write_tar(tmp_path / f"s{n}.tar", 100 * n, size)
              for n, size in enumerate([10, 10, 10, 20])]

    def make(urls: list[str]) -> aioloader.Loader:
        return aioloader.Loader(aioloader.TarShards(urls, index_dir=tmp_path / "index"),
                                batch_size=5, shuffle=True, num_workers=0)

    state = saved_after(make(shards), 3)
    with pytest.raises(aioloader.LoaderError,
                       match=r"saved for other data: unit_sizes \w{16}, now \w{16};"):
        make(shards[::-1]).load_state_dict(state)
    with pytest.raises(aioloader.LoaderError,
                       match=r"samples 50, now 30; units 4, now 3; unit_sizes "):
        make(shards[:3]).load_state_dict(state)
    make(shards).load_state_dict(state)


@pytest.mark.parametrize("world_size", [1, 3])
def test_len_after_load_state_dict_is_the_batches_the_resumed_pass_gives(
    local_paths: list[str], world_size: int
) -> None:
    """Progress bars and schedulers read len() after a resume: it is what the pass gives."""
    def ranks() -> list[aioloader.Loader]:
        return [aioloader.Loader(aioloader.Files(local_paths), decode=index_and_noise,
                                 batch_size=3, shuffle=True, seed=2, num_workers=0,
                                 rank=rank, world_size=world_size)
                for rank in range(world_size)]

    first = ranks()
    whole = len(first[0])
    states: list[dict[str, Any]] = []
    indices_in_lockstep(first, 4, states)
    for loader in ranks():
        loader.load_state_dict(states[0])
        assert len(loader) == whole - 4
        assert len(loader) == len(list(loader))
        assert len(loader) == whole  # the next epoch, whole
