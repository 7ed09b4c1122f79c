"""Epochs of streams divided by samples: every rank takes the same steps, no sample is lost,
and a job resumes on any world size (tar shards and Parquet row groups of uneven sizes)."""

from __future__ import annotations

import io
import json
import os
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._datasets.tarshards import INDEX_SUFFIX
from aioloader._sampling import Division, ShardInfo
from aioloader.testing import TestServer

UNEVEN = [13, 5, 9, 1, 30, 2, 7, 11, 4]
"""Samples per shard: 82 in 9 shards, as a user's last shards often are."""


def write_shards(folder: Path, sizes: list[int] = UNEVEN) -> list[str]:
    paths, first = [], 0
    for n, size in enumerate(sizes):
        path = folder / f"part-{n:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(first, first + size):
                for extension, data in (("txt", b"%d" % i), ("cls", b"%d" % (i % 3))):
                    info = tarfile.TarInfo(f"{i:05d}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
        first += size
    return paths


def ids(batch: dict[str, Any]) -> list[int]:
    return [int(text) for text in batch["txt"]]


def loader_for(shards: aioloader.TarShards, rank: int, world_size: int,
               **options: Any) -> aioloader.Loader:
    settings: dict[str, Any] = dict(batch_size=4, num_workers=0, seed=3, shuffle=True)
    return aioloader.Loader(shards, rank=rank, world_size=world_size, **(settings | options))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_tar_shards_give_every_rank_the_same_steps_and_lose_no_sample(
    tmp_path: Path, world_size: int, drop_last: bool
) -> None:
    shards = aioloader.TarShards(write_shards(tmp_path), shuffle_buffer=10)
    steps, seen = set(), []
    for rank in range(world_size):
        loader = loader_for(shards, rank, world_size, drop_last=drop_last)
        batches = [ids(batch) for batch in loader]
        assert len(batches) == len(loader)  # len() is known before the epoch
        steps.add(len(batches))
        seen += [i for batch in batches for i in batch]
    assert len(steps) == 1
    per_rank = 82 // world_size if drop_last else -(-82 // world_size)
    if drop_last:  # no repeats, at most one batch per rank left out
        assert len(set(seen)) == len(seen) and 82 - len(seen) < world_size * 4 + world_size
        assert steps == {per_rank // 4}
    else:  # every sample, repeats only to pad
        assert set(seen) == set(range(82)) and len(seen) - 82 < world_size
        assert steps == {-(-per_rank // 4)}


def test_each_rank_reads_only_its_range_of_the_shards(server: TestServer,
                                                     sample_dir: Path) -> None:
    folder = sample_dir / "division-range"
    folder.mkdir()
    names = [Path(p).name for p in write_shards(folder, [40] * 4)]
    urls = [f"{server.url}division-range/{name}" for name in names]
    shards = aioloader.TarShards(urls, shuffle_buffer=0)
    whole = sum((folder / name).stat().st_size for name in names)
    for rank in range(4):
        loader = loader_for(shards, rank, 4, shuffle=False)
        assert [i for batch in loader for i in ids(batch)] == list(range(rank * 40,
                                                                         rank * 40 + 40))
        assert loader.stats.storage.bytes_read < whole / 3  # a quarter, give or take headers


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2), (4, 1), (2, 2)])
def test_a_tar_epoch_resumes_on_another_world_size_with_nothing_skipped(
    tmp_path: Path, before: int, after: int
) -> None:
    shards = aioloader.TarShards(write_shards(tmp_path), shuffle_buffer=10)
    taken: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(before):
        with loader_for(shards, rank, before) as loader:
            loader.set_epoch(2)
            for n, batch in enumerate(loader, 1):
                taken += ids(batch)
                if n == 3:
                    state = json.loads(json.dumps(loader.state_dict()))  # inside the loop
                    break
    assert state["position"] == 3 * 4 * before
    rest: list[int] = []
    steps = set()
    for rank in range(after):
        with loader_for(shards, rank, after) as loader:
            loader.load_state_dict(state)
            loader.set_epoch(2)  # the resumed epoch: keeps the saved position
            batches = [ids(batch) for batch in loader]
            steps.add(len(batches))
            rest += [i for batch in batches for i in batch]
            assert loader.epoch == 3
    assert len(steps) == 1
    assert set(taken) | set(rest) == set(range(82)) and not set(taken) & set(rest[: -after])
    assert len(taken) + len(rest) - 82 < before + after  # repeats only from padding


def test_a_tar_epoch_resumed_on_the_same_world_size_equals_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    shards = aioloader.TarShards(write_shards(tmp_path), shuffle_buffer=10)
    for rank in range(2):
        whole = [ids(b) for b in loader_for(shards, rank, 2)]
        with loader_for(shards, rank, 2, num_workers=2) as first:
            taken = []
            for batch in first:
                taken.append(ids(batch))
                if len(taken) == 4:
                    state = first.state_dict()
                    break
        second = loader_for(shards, 1 - rank, 2)  # any rank's state resumes every rank
        second.load_state_dict(state)
        other = [ids(b) for b in loader_for(shards, 1 - rank, 2)]
        assert [ids(b) for b in second] == other[4:]
        resumed = loader_for(shards, rank, 2)
        resumed.load_state_dict(state)
        assert taken + [ids(b) for b in resumed] == whole


def test_the_rng_of_a_sample_does_not_depend_on_the_world_size(tmp_path: Path) -> None:
    shards = aioloader.TarShards(write_shards(tmp_path), shuffle_buffer=10)

    def noise(sample: dict[str, Any], rng: np.random.Generator) -> tuple[int, float]:
        return int(sample["txt"]), float(rng.random())

    draws: dict[int, set[float]] = {}
    for world_size in (1, 3):
        for rank in range(world_size):
            loader = loader_for(shards, rank, world_size, decode=noise, batch_size=None)
            for key, value in loader:
                draws.setdefault(key, set()).add(value)
    assert all(len(values) == 1 for values in draws.values())


def test_an_index_beside_the_shard_is_used_and_one_made_by_reading_is_kept(
    server: TestServer, sample_dir: Path
) -> None:
    folder = sample_dir / "division-index"
    folder.mkdir()
    names = [Path(p).name for p in write_shards(folder, [6, 7])]
    urls = [f"{server.url}division-index/{name}" for name in names]
    before = server.stats()["requests"]
    first = aioloader.TarShards(urls)  # no index beside them: each shard is read once
    requests = server.stats()["requests"] - before
    before = server.stats()["requests"]
    again = aioloader.TarShards(urls)  # kept in the cache folder: no shard read again
    assert requests - (server.stats()["requests"] - before) == len(names)
    assert len(again) == len(first) == 13
    (folder / (names[0] + INDEX_SUFFIX)).write_text(json.dumps(
        {"format": "aioloader-tar-index", "version": 1,
         "size": (folder / names[0]).stat().st_size, "starts": [0]}))
    beside = aioloader.TarShards(urls)  # the index beside the shard wins (here: it lies)
    assert len(beside) == 1 + 7


def test_a_shard_that_changed_since_it_was_indexed_fails_naming_it(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [5, 5])
    shards = aioloader.TarShards(paths, index_dir=tmp_path / "index")
    Path(paths[1] + INDEX_SUFFIX).write_text(json.dumps(
        {"format": "aioloader-tar-index", "version": 1,
         "size": Path(paths[1]).stat().st_size, "starts": [0, 1024, 2048]}))
    changed = aioloader.TarShards(paths, index_dir=tmp_path / "index")
    assert len(shards) == 10 and len(changed) == 5 + 3
    with pytest.raises(aioloader.LoaderError, match=r"part-001\.tar.*changed since it was"):
        list(aioloader.Loader(changed, batch_size=None, num_workers=0))


def test_parquet_with_uneven_row_groups_loses_no_row_at_eight_ranks(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    first = 0
    for n, rows in enumerate([1000, 333, 700]):
        table = pa.table({"id": np.arange(first, first + rows)})
        pq.write_table(table, tmp_path / f"f{n}.parquet", row_group_size=256)
        first += rows
    data = aioloader.Parquet(str(tmp_path / "f{0..2}.parquet"))
    for shuffle in (False, True):
        seen, steps = [], set()
        for rank in range(8):
            loader = aioloader.Loader(data, batch_size=16, num_workers=0, rank=rank,
                                      world_size=8, shuffle=shuffle)
            batches = [b["id"].tolist() for b in loader]
            steps.add(len(batches))
            seen += [i for b in batches for i in b]
        assert len(steps) == 1 and set(seen) == set(range(first))
        assert len(seen) - first < 8


def test_set_epoch_after_load_state_dict_keeps_the_saved_position(
    local_paths: list[str],
) -> None:
    def make() -> aioloader.Loader:
        return aioloader.Loader(aioloader.Files(local_paths), batch_size=8, num_workers=0,
                                shuffle=True)

    first = make()
    first.set_epoch(1)
    steps = len(first)
    for n, _ in enumerate(first, 1):
        if n == 3:
            state = first.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # what a training loop does at the top of each epoch
    assert len(list(resumed)) == steps - 3
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # another epoch: from its start
    assert len(list(resumed)) == steps


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"epoch": 0, "position": -1}, "'position' must be an integer >= 0"),
        ({"epoch": 1.5, "position": 0}, "'epoch' must be an integer >= 0"),
        ({}, "'epoch' must be an integer >= 0"),
        ({"epoch": True, "position": 0}, "'epoch' must be an integer >= 0"),
        ({"epoch": 0, "position": 10**6}, "past the end of the epoch"),
        ([0, 1], "a loader state is the dict"),
    ],
)
def test_load_state_dict_refuses_a_state_that_does_not_fit(
    local_paths: list[str], state: Any, message: str
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), num_workers=0)
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


def test_load_state_dict_refuses_remaining_positions_outside_the_data(tmp_path: Path) -> None:
    shards = aioloader.TarShards(write_shards(tmp_path))
    loader = aioloader.Loader(shards, num_workers=0)
    for remaining in ([[5, 3]], [[0, 83]], [[4, 9], [2, 3]], "all", [[0, 1.5]]):
        with pytest.raises(ValueError, match="'remaining' must be increasing"):
            loader.load_state_dict({"epoch": 0, "position": 0, "remaining": remaining})


def test_a_recordio_part_in_a_loader_that_divides_by_rank_is_refused(tmp_path: Path) -> None:
    from aioloader import recordio

    with recordio.Writer(str(tmp_path / "d.rec"), str(tmp_path / "d.idx")) as writer:
        for i in range(8):
            writer.write(b"%d" % i, key=i)
    part = aioloader.RecordIO(str(tmp_path / "d.rec"), num_parts=2, part_index=1)
    with pytest.raises(ValueError, match=r"part of 2 already.*1/4 of the data"):
        aioloader.Loader(part, rank=1, world_size=2, num_workers=0)
    assert len(list(aioloader.Loader(part, batch_size=None, num_workers=0))) == 4


def test_a_dataset_that_is_not_one_is_refused_when_the_loader_is_built() -> None:
    class Lookalike:
        def __len__(self) -> int:
            return 3

        async def fetch(self, index: int) -> bytes:
            return b""

    with pytest.raises(TypeError, match=r"must be an aioloader\.Dataset"):
        aioloader.Loader(Lookalike(), num_workers=0)  # type: ignore[arg-type]


def test_division_pads_from_the_epoch_start_so_a_resume_pads_alike() -> None:
    whole = Division(10, ShardInfo(2, 3, 0, 0, False))
    assert whole.positions() == [(8, 10), (0, 2)]
    after = whole.remaining_after(2)
    assert after == ((2, 4), (6, 8))  # rank 2's pads were never remaining
    resumed = Division(10, ShardInfo(2, 3, 0, 0, False, remaining=after))
    assert resumed.positions() == [(0, 2)]


def test_parquet_files_whose_schemas_differ_are_refused_naming_both(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": pa.array([1, 2], pa.int32())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([3], pa.int64()), "x": [1]}), tmp_path / "b.parquet")
    with pytest.raises(aioloader.ParquetError, match=r"id: int32 in .*a\.parquet, int64 in "
                                                     r".*b\.parquet; x: missing in"):
        aioloader.Parquet(str(tmp_path / "{a,b}.parquet"))


def test_a_valid_parquet_file_without_rows_is_read_as_empty(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": pa.array([], pa.int64())}), tmp_path / "empty.parquet")
    pq.write_table(pa.table({"id": pa.array([7, 8], pa.int64())}), tmp_path / "full.parquet")
    data = aioloader.Parquet(str(tmp_path / "{empty,full}.parquet"))
    rows = list(aioloader.Loader(data, batch_size=None, num_workers=0))
    assert [int(r["id"]) for r in rows] == [7, 8]


def test_a_shuffled_stream_in_a_mixture_is_reshuffled_every_pass(tmp_path: Path) -> None:
    shards = aioloader.TarShards(write_shards(tmp_path, [10, 10]), shuffle_buffer=20)
    (tmp_path / "other").mkdir()
    files = aioloader.Files(write_shards(tmp_path / "other", [1]))
    mix = aioloader.Mix({"tar": shards, "files": files}, weights=[1, 0], samples_per_epoch=60)
    loader = aioloader.Loader(mix, decode=lambda m: int(m.item["txt"]), batch_size=None,
                              num_workers=0, shuffle=True)
    taken = list(loader)
    passes = [taken[i : i + 20] for i in range(0, 60, 20)]
    assert all(sorted(p) == list(range(20)) for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # each pass is the source's own epoch


def test_a_shuffle_window_larger_than_the_memory_limit_allows_is_named(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    blobs = pa.array([os.urandom(64 << 10) for _ in range(64)])  # 4 MiB: row groups of 1 MiB
    pq.write_table(pa.table({"blob": blobs}), tmp_path / "big.parquet", row_group_size=16,
                   compression="none")
    data = aioloader.Parquet(str(tmp_path / "big.parquet"), shuffle_window=2)
    loader = aioloader.Loader(data, batch_size=None, num_workers=0, shuffle=True,
                              memory_limit=2 << 20)
    with pytest.warns(RuntimeWarning, match=r"a shuffle window reads about 2 MiB, over the 1 MiB"):
        assert len(list(loader)) == 64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        len(list(aioloader.Loader(data, batch_size=None, num_workers=0, shuffle=True)))
