"""WebDataset tar shards written by Python's tarfile, read from disk, nginx and the test server."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader._datasets.tarshards import expand_braces
from aioloader._tar import TarFormatError
from aioloader.testing import Nginx, TestServer


def write_shard(path: Path, files: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, shards: int = 4, per_shard: int = 10) -> list[str]:
    names = []
    for s in range(shards):
        files = []
        for i in range(s * per_shard, (s + 1) * per_shard):
            files += [(f"train/{i:05d}.jpg", b"jpeg%d" % i), (f"train/{i:05d}.cls", b"%d" % i)]
        names.append(f"shard-{s:03d}.tar")
        write_shard(folder / names[-1], files)
    return names


def label(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def labels_of(loader: aioloader.Loader) -> list[int]:
    return [int(x) for batch in loader for x in batch]


def read_samples(urls: str | list[str]) -> list[dict[str, Any]]:
    return list(aioloader.Loader(aioloader.TarShards(urls), batch_size=None, num_workers=0))


def test_files_are_grouped_by_webdataset_rules(tmp_path: Path) -> None:
    long_key = "deep/" * 30 + "sample"
    write_shard(tmp_path / "a.tar", [
        ("__index__", b"metadata, skipped"),
        ("x/one.JPG", b"j1"), ("x/one.seg.png", b"s1"), ("x/one.cls", b"1"),
        ("noextension", b"skipped"),
        ("x/two.jpg", b"j2"),
        (long_key + ".txt", b"long names come through pax headers"),
    ])
    samples = read_samples(str(tmp_path / "a.tar"))
    assert [s["__key__"] for s in samples] == ["x/one", "x/two", long_key]
    assert samples[0] == {
        "__key__": "x/one", "__url__": str(tmp_path / "a.tar"),
        "jpg": b"j1", "seg.png": b"s1", "cls": b"1",
    }
    assert samples[2]["txt"] == b"long names come through pax headers"


def test_repeated_extension_names_the_shard_and_key(tmp_path: Path) -> None:
    write_shard(tmp_path / "dup.tar", [("k.jpg", b"1"), ("k.JPG", b"2")])
    with pytest.raises(TarFormatError, match=r"dup\.tar: sample 'k' has more than one 'jpg' file"):
        read_samples(str(tmp_path / "dup.tar"))


def test_truncated_shard_names_the_shard(tmp_path: Path) -> None:
    write_shards(tmp_path, shards=1)
    data = (tmp_path / "shard-000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:1300])
    with pytest.raises(TarFormatError, match=r"cut\.tar: truncated tar"):
        read_samples(str(tmp_path / "cut.tar"))


def test_brace_expansion() -> None:
    assert expand_braces("train-{000..002}.tar") == [
        "train-000.tar", "train-001.tar", "train-002.tar"
    ]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]


def test_shards_in_order_without_shuffle_decoded_in_the_pool(tmp_path: Path) -> None:
    write_shards(tmp_path)
    loader = aioloader.Loader(
        aioloader.TarShards(str(tmp_path / "shard-{000..003}.tar")), decode=label, batch_size=8
    )
    with loader:
        assert labels_of(loader) == list(range(40))


def test_same_samples_from_disk_nginx_and_test_server(nginx: Nginx, web_root: Path) -> None:
    folder = web_root / "tar-shards"
    folder.mkdir()
    names = write_shards(folder)
    local = read_samples(str(folder / "shard-{000..003}.tar"))
    over_nginx = read_samples(nginx.url + "tar-shards/shard-{000..003}.tar")
    with TestServer(folder, latency_ms=5) as server:
        over_test_server = read_samples([server.url + n for n in names])
    strip = [{k: v for k, v in s.items() if k != "__url__"} for s in local]
    for other in (over_nginx, over_test_server):
        assert [{k: v for k, v in s.items() if k != "__url__"} for s in other] == strip
    assert over_nginx[0]["__url__"] == nginx.url + "tar-shards/shard-000.tar"


def test_shuffle_is_reproducible_and_ranks_are_disjoint(tmp_path: Path) -> None:
    write_shards(tmp_path, shards=6)
    shards = aioloader.TarShards(str(tmp_path / "shard-{000..005}.tar"), shuffle_buffer=16)

    def epoch(rank: int, world_size: int, epoch: int = 0) -> list[int]:
        loader = aioloader.Loader(
            shards, decode=label, batch_size=4, shuffle=True, seed=9, num_workers=0,
            rank=rank, world_size=world_size,
        )
        loader.set_epoch(epoch)
        return labels_of(loader)

    whole = epoch(0, 1)
    assert sorted(whole) == list(range(60)) and whole != list(range(60))
    assert epoch(0, 1) == whole and epoch(0, 1, epoch=1) != whole
    shares = [epoch(r, 3) for r in range(3)]
    assert sorted(x for share in shares for x in share) == list(range(60))
    assert all(len(share) == 20 for share in shares)


def test_fetch_errors_in_a_stream_name_the_shard(server: TestServer) -> None:
    with pytest.raises(aioloader.LoaderError, match=r"missing-shard\.tar.*404"):
        read_samples(server.url + "missing-shard.tar")
