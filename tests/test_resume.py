"""Resuming mid-epoch: the same batches as an uninterrupted run, whatever the workers, and
elastic resumption on another number of ranks with nothing skipped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioloader
from aioloader import recordio

from decoders import index_and_noise

SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def batches_of(loader: aioloader.Loader, limit: int | None = None) -> list[list[float]]:
    """Each batch as a list of (index, first noise value) pairs, flattened."""
    out = []
    for batch in loader:
        out.append(np.column_stack([batch["index"], batch["noise"][:, 0]]).ravel().tolist())
        if limit is not None and len(out) == limit:
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
        taken = batches_of(first, limit=break_at)
        state = json.loads(json.dumps(first.state_dict()))
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
        taken = batches_of(first, limit=break_at)
        state = first.state_dict()
    with make(0) as second:
        second.load_state_dict(state)
        assert taken + batches_of(second) == uninterrupted


def indices_in_lockstep(loaders: list[aioloader.Loader], steps: int | None) -> list[int]:
    """Step all ranks together, as distributed training does; the indices they took."""
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
    taken = indices_in_lockstep(first, steps)
    state = first[-1].state_dict()  # any rank's state resumes every rank
    assert all(loader.state_dict() == state for loader in first)
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
