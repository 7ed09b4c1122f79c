"""Parquet rows, from files written by pyarrow and by Hugging Face datasets, read from disk, the
test server, nginx and an S3 server, against what pyarrow itself reads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._datasets.parquet import TAIL_BYTES
from aioloader.testing import Nginx, TestServer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DATA = Path(__file__).parent / "data"
WORDS = ["cat", "dog", "bird", "fish"]
GROUPED = ["groups.parquet", "zstd.parquet", "single.parquet"]
"""Written here by pyarrow, one schema, ids unique across them."""
HF = ["hf_snappy.parquet", "hf_single_group.parquet"]
"""Written by datasets' to_parquet (tests/data/make_hf_parquet.py)."""
ALL = GROUPED + HF


def table(count: int, first: int) -> Any:
    ids = range(first, first + count)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "score": pa.array([i / 4 for i in ids], pa.float32()),
        "flag": [i % 3 == 0 for i in ids],
        "name": [WORDS[i % 4] for i in ids],  # four values: dictionary-encoded pages
        "category": pa.array([WORDS[i % 2] for i in ids]).dictionary_encode(),  # Arrow dictionary
        "blob": [bytes([i % 256]) * (i % 5) for i in ids],
        "tags": [WORDS[: i % 3] for i in ids],
        "vec": pa.array([[i + k / 2 for k in range(i % 4)] for i in ids], pa.list_(pa.float32())),
        "fixed": pa.array([[i, -i, 2 * i] for i in ids], pa.list_(pa.int16(), 3)),
        "point": [{"x": i, "y": str(i)} for i in ids],
        "boxes": [[{"x": i, "w": k} for k in range(i % 3)] for i in ids],
        "nested": [[[i] * k for k in range(i % 3)] for i in ids],
        "maybe": [None if i % 5 == 0 else i for i in ids],
        "maybe_point": [None if i % 7 == 0 else {"x": i, "y": "p"} for i in ids],
    })


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six row groups (five of 40 rows, one of 30) with snappy; three with zstd; one with zstd;
    and the committed files from datasets."""
    here = tmp_path_factory.mktemp("parquet")
    pq.write_table(table(230, 0), here / "groups.parquet", row_group_size=40)
    pq.write_table(table(150, 1000), here / "zstd.parquet", row_group_size=64,
                   compression="zstd")
    pq.write_table(table(57, 2000), here / "single.parquet", compression="zstd")
    for name in HF:
        shutil.copy(DATA / name, here / name)
    return here


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[TestServer]:
    with TestServer(folder) as running:
        yield running


@pytest.fixture(scope="module")
def on_nginx(folder: Path, nginx: Nginx, web_root: Path) -> str:
    shutil.copytree(folder, web_root / "parquet")
    return nginx.url + "parquet/"


@pytest.fixture(scope="module")
def bucket(folder: Path, s3_endpoint: str) -> str:
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="tables")
    for name in ALL:
        client.put_object(Bucket="tables", Key=name, Body=(folder / name).read_bytes())
    return "s3://tables/"


def plain(value: Any) -> Any:
    """Python values, as pyarrow's to_pylist gives them."""
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def expected(folder: Path, names: list[str], columns: list[str] | None = None) -> list[Any]:
    return [row for n in names for row in pq.read_table(folder / n, columns=columns).to_pylist()]


def rows_of(dataset: aioloader.Parquet, **loader: Any) -> list[dict[str, Any]]:
    return list(aioloader.Loader(dataset, batch_size=None, num_workers=0, **loader))


def ids_of(dataset: aioloader.Parquet, **loader: Any) -> list[int]:
    return [int(row["id"]) for row in rows_of(dataset, **loader)]


def chunk_bytes(path: Path, columns: set[str]) -> int:
    """What the requested columns' chunks take in the file, from pyarrow's own metadata."""
    metadata = pq.read_metadata(path)
    total = 0
    for g in range(metadata.num_row_groups):
        for j in range(metadata.num_columns):
            chunk = metadata.row_group(g).column(j)
            if chunk.path_in_schema.split(".")[0] in columns:
                total += chunk.total_compressed_size
    return total


def test_import_does_not_import_pyarrow() -> None:
    code = "import sys, aioloader; print('pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ALL)
def test_rows_equal_what_pyarrow_reads(folder: Path, name: str) -> None:
    dataset = aioloader.Parquet(str(folder / name))
    rows = rows_of(dataset)
    assert len(dataset) == len(rows)
    assert [plain(row) for row in rows] == expected(folder, [name])


def test_values_come_column_wise_as_numpy_and_python_types(folder: Path) -> None:
    metadata = pq.read_metadata(folder / "groups.parquet")
    assert metadata.num_row_groups == 6
    name_column = next(j for j in range(metadata.num_columns)
                       if metadata.schema.column(j).path == "name")
    assert metadata.row_group(0).column(name_column).has_dictionary_page
    row = rows_of(aioloader.Parquet(str(folder / "groups.parquet")))[41]
    assert isinstance(row["id"], np.int64) and isinstance(row["score"], np.float32)
    assert isinstance(row["flag"], np.bool_)
    assert row["name"] == "dog" and row["category"] == "dog" and row["blob"] == b"\x29"
    assert isinstance(row["tags"], np.ndarray) and row["tags"].tolist() == ["cat", "dog"]
    assert row["vec"].dtype == np.float32 and row["vec"].tolist() == [41.0]
    assert row["fixed"].dtype == np.int16 and row["fixed"].tolist() == [41, -41, 82]
    assert row["point"] == {"x": 41, "y": "41"}
    assert plain(row["boxes"]) == [{"x": 41, "w": 0}, {"x": 41, "w": 1}]
    assert isinstance(row["nested"], list) and plain(row["nested"]) == [[], [41]]
    assert row["maybe"] == 41 and isinstance(row["maybe"], np.int64)
    assert rows_of(aioloader.Parquet(str(folder / "groups.parquet")))[42]["maybe_point"] is None


def test_same_rows_from_test_server_nginx_and_s3(
    folder: Path, server: TestServer, on_nginx: str, bucket: str
) -> None:
    for base in (server.url, on_nginx, bucket):  # files of one schema make one dataset
        ours = aioloader.Parquet(base + "{groups,zstd,single}.parquet")
        assert [plain(row) for row in rows_of(ours)] == expected(folder, GROUPED), base
        for name in HF:
            theirs = aioloader.Parquet(base + name)
            assert [plain(row) for row in rows_of(theirs)] == expected(folder, [name]), base


def test_batches_decoded_in_processes(folder: Path, server: TestServer) -> None:
    dataset = aioloader.Parquet([server.url + n for n in GROUPED], columns=["id", "score", "fixed"])
    with aioloader.Loader(dataset, batch_size=16, num_workers=2) as loader:
        batches = list(loader)
    assert batches[0]["score"].dtype == np.float32 and batches[0]["fixed"].shape == (16, 3)
    want = expected(folder, GROUPED, ["id", "score", "fixed"])
    assert np.concatenate([b["id"] for b in batches]).tolist() == [r["id"] for r in want]
    assert np.concatenate([b["fixed"] for b in batches]).tolist() == [r["fixed"] for r in want]


def test_only_requested_columns_are_fetched_and_each_footer_once(
    folder: Path, server: TestServer
) -> None:
    before = server.stats()["requests"]
    dataset = aioloader.Parquet(server.url + "groups.parquet", columns=["id", "tags"])
    assert server.stats()["requests"] - before == 2  # the size, then one read of the tail
    loader = aioloader.Loader(dataset, batch_size=None, num_workers=0)
    rows = list(loader)
    assert [plain(r) for r in rows] == expected(folder, ["groups.parquet"], ["id", "tags"])
    assert loader.stats.bytes_read == chunk_bytes(folder / "groups.parquet", {"id", "tags"})
    assert server.stats()["requests"] - before == 2 + loader.stats.requests
    assert loader.stats.requests <= 2 * 6  # at most one per chunk: the footer is not read again


def test_a_footer_longer_than_the_tail_read_takes_one_more_read(
    folder: Path, server: TestServer
) -> None:
    wide = pa.table({f"column_with_a_long_name_{j:04d}": [j, j + 1] for j in range(800)})
    pq.write_table(wide, folder / "wide.parquet")
    assert pq.read_metadata(folder / "wide.parquet").serialized_size > TAIL_BYTES
    before = server.stats()["requests"]
    dataset = aioloader.Parquet(server.url + "wide.parquet",
                                columns=["column_with_a_long_name_0799"])
    assert server.stats()["requests"] - before == 3
    assert [plain(r) for r in rows_of(dataset)] == [
        {"column_with_a_long_name_0799": 799}, {"column_with_a_long_name_0799": 800}
    ]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_get_equal_shares_of_uneven_row_groups_and_lose_no_row(
    folder: Path, shuffle: bool, drop_last: bool
) -> None:
    dataset = aioloader.Parquet([str(folder / n) for n in GROUPED], shuffle_window=2)
    every = sorted(int(r["id"]) for r in expected(folder, GROUPED, ["id"]))
    for world_size in (1, 2, 3, 4, 8):
        shares = []
        for rank in range(world_size):
            loader = aioloader.Loader(dataset, batch_size=None, num_workers=0, shuffle=shuffle,
                                      seed=4, rank=rank, world_size=world_size,
                                      drop_last=drop_last)
            rows = len(loader)
            shares.append([int(row["id"]) for row in loader])
            assert len(shares[-1]) == rows
        assert len({len(share) for share in shares}) == 1  # ranks step together
        seen = [i for share in shares for i in share]
        if drop_last:  # no repeats; fewer than world_size rows left out
            assert len(set(seen)) == len(seen) and len(every) - len(seen) < world_size
        else:  # every row, and repeats only to pad the last rank's share
            assert set(seen) == set(every) and len(seen) - len(every) < world_size
        if world_size == 1:
            assert (seen == every) != shuffle  # file order unless shuffling


def test_two_ranks_share_a_single_row_group(folder: Path) -> None:
    dataset = aioloader.Parquet(str(folder / "single.parquet"))
    shares = [[int(r["id"]) for r in aioloader.Loader(
        dataset, batch_size=None, num_workers=0, rank=rank, world_size=2)] for rank in (0, 1)]
    every = sorted(int(r["id"]) for r in expected(folder, ["single.parquet"], ["id"]))
    assert len(shares[0]) == len(shares[1]) and set(shares[0] + shares[1]) == set(every)


def test_rows_are_shuffled_within_windows_of_about_shuffle_window_row_groups(
    folder: Path,
) -> None:
    dataset = aioloader.Parquet(str(folder / "groups.parquet"), shuffle_window=2)
    window = 2 * (230 // 6)  # row groups of 40 rows and one of 30

    def epoch(epoch: int, seed: int = 1) -> list[int]:
        loader = aioloader.Loader(dataset, batch_size=None, num_workers=0, shuffle=True,
                                  seed=seed)
        loader.set_epoch(epoch)
        return [int(row["id"]) for row in loader]

    order = epoch(0)
    assert sorted(order) == list(range(230)) and order != sorted(order)
    for start in range(0, 230, window):  # a window spans a few neighbouring row groups
        assert len({i // 40 for i in order[start : start + window]}) <= 4
    first = order[:window]
    assert first != sorted(first)  # mixed within the window, not just row groups reordered
    assert epoch(0) == order
    assert epoch(1) != order and sorted(epoch(1)) == sorted(order)
    assert epoch(0, seed=2) != order


def batched_ids(loader: aioloader.Loader, limit: int | None = None,
                saved: list[dict[str, Any]] | None = None) -> list[list[int]]:
    """The ids of a pass, or of its first `limit` batches; then the state is put in `saved`,
    taken inside the loop, as a resumable job saves it."""
    out = []
    for batch in loader:
        out.append(batch["id"].tolist())
        if len(out) == limit:
            if saved is not None:
                saved.append(json.loads(json.dumps(loader.state_dict())))
            break
    return out


@pytest.mark.parametrize(
    ("break_at", "shuffle", "workers"), [(1, False, 0), (9, True, 0), (20, True, 2), (13, False, 0)]
)
def test_resume_continues_exactly_without_reading_skipped_windows(
    folder: Path, break_at: int, shuffle: bool, workers: int
) -> None:
    def make(num_workers: int) -> aioloader.Loader:
        dataset = aioloader.Parquet([str(folder / n) for n in GROUPED],
                                    columns=["id", "name", "fixed"], shuffle_window=2)
        loader = aioloader.Loader(dataset, batch_size=8, shuffle=shuffle, seed=11,
                                  num_workers=num_workers, rank=1, world_size=2)
        loader.set_epoch(3)
        return loader

    with make(0) as whole:
        uninterrupted = batched_ids(whole)
    with make(workers) as first:
        saved: list[dict[str, Any]] = []
        taken = batched_ids(first, limit=break_at, saved=saved)
        state = saved[0]
    with make(0) as second:
        second.load_state_dict(state)
        assert taken + batched_ids(second) == uninterrupted
        if break_at >= 13:  # over half the epoch: its first windows are not read again
            assert second.stats.bytes_read < whole.stats.bytes_read * 0.7


def fail_on_row_45(row: dict[str, Any]) -> dict[str, Any]:
    if row["id"] == 45:
        raise ValueError("row 45 is bad")
    return row


def test_decode_errors_name_the_file_row_group_and_row(folder: Path) -> None:
    path = str(folder / "groups.parquet")
    loader = aioloader.Loader(aioloader.Parquet(path), decode=fail_on_row_45, batch_size=None,
                              num_workers=0)
    with pytest.raises(aioloader.SampleError, match=re.escape(f"{path}#1/5")):
        list(loader)


def footer_length(data: bytes) -> int:
    return int.from_bytes(data[-8:-4], "little")


def corrupt_metadata(data: bytes) -> bytes:
    length = footer_length(data)
    return data[: -8 - length] + b"\xff" * length + data[-8:]


def footer_only(data: bytes) -> bytes:
    return data[:4] + data[-8 - footer_length(data) :]


def oversized_length(data: bytes) -> bytes:
    return data[:-8] + (10**9).to_bytes(4, "little") + data[-4:]


@pytest.mark.parametrize(
    ("damage", "cause"),
    [
        (lambda data: b"just some text, long enough", "no Parquet footer"),
        (lambda data: data[: len(data) // 2], r"no Parquet footer.*truncated"),
        (lambda data: data[:10], "10 bytes, too short for a Parquet file"),
        (corrupt_metadata, "corrupt footer"),
        (oversized_length, "corrupt footer: its length 1000000000 exceeds the file"),
        (footer_only, r"row group 0, column id claims bytes .* truncated or corrupt"),
    ],
    ids=["not parquet", "truncated", "tiny", "garbage metadata", "bad length", "data cut out"],
)
def test_damaged_files_fail_at_construction_naming_file_and_cause(
    folder: Path, tmp_path: Path, damage: Any, cause: str
) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(damage((folder / "groups.parquet").read_bytes()))
    with pytest.raises(aioloader.ParquetError, match=re.escape(str(bad)) + ": " + cause):
        aioloader.Parquet(str(bad))


def test_damaged_row_group_names_file_and_row_group(folder: Path, tmp_path: Path) -> None:
    data = bytearray((folder / "zstd.parquet").read_bytes())
    chunk = pq.read_metadata(folder / "zstd.parquet").row_group(1).column(0)
    start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    bad = tmp_path / "bad-group.parquet"
    bad.write_bytes(bytes(data))
    with pytest.raises(aioloader.ParquetError,
                       match=re.escape(str(bad)) + ": row group 1 could not be decoded"):
        rows_of(aioloader.Parquet(str(bad)))


def test_missing_column_fails_at_construction(folder: Path, server: TestServer) -> None:
    url = server.url + "hf_snappy.parquet"
    with pytest.raises(aioloader.ParquetError,
                       match=re.escape(url) + r": no column 'labels'; the file has .*'label'"):
        aioloader.Parquet(url, columns=["text", "labels"])
