"""`aioloader pack` and `aioloader inspect`, run as a user runs them."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

import aioloader
from aioloader import recordio
from aioloader._tools.packing import ImageOptions, pack_recordio, pack_tar

Image = pytest.importorskip("PIL.Image")


def make_tree(root: Path) -> list[tuple[str, int]]:
    """Two classes of small JPEGs; returns (relative path, label) in ImageFolder order."""
    expected = []
    for label, name in enumerate(["cat", "dog"]):
        (root / name).mkdir(parents=True)
        for i in range(5):
            path = root / name / f"{i}.jpg"
            Image.new("RGB", (40 + i, 30), (label * 200, i * 40, 0)).save(path, quality=90)
            expected.append((f"{name}/{i}.jpg", label))
    return expected


def run_cli(*arguments: str) -> str:
    done = subprocess.run([sys.executable, "-m", "aioloader", *arguments], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout


def test_pack_folder_to_rec_keeps_bytes_labels_and_order(tmp_path: Path) -> None:
    expected = make_tree(tmp_path / "src")
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "out.rec"), "--processes", "2")
    dataset = aioloader.RecordIO(str(tmp_path / "out.rec"), str(tmp_path / "out.idx"))
    records = list(aioloader.Loader(dataset, batch_size=None, num_workers=0))
    assert len(records) == len(expected)
    for n, (record, (relative, label)) in enumerate(zip(records, expected, strict=True)):
        header, payload = recordio.unpack(record)
        assert (header.label, header.id) == (label, n)
        assert payload == (tmp_path / "src" / relative).read_bytes()
    assert (tmp_path / "out.idx").read_text().splitlines()[3].startswith("3\t")


def test_output_does_not_depend_on_the_number_of_processes(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    options = ImageOptions(resize=20, quality=80)
    pack_recordio(tmp_path / "src", tmp_path / "one.rec", options, processes=1)
    pack_recordio(tmp_path / "src", tmp_path / "two.rec", options, processes=2)
    assert (tmp_path / "one.rec").read_bytes() == (tmp_path / "two.rec").read_bytes()
    _, payload = recordio.unpack(next(iter(aioloader.Loader(
        aioloader.RecordIO(str(tmp_path / "one.rec")), batch_size=None, num_workers=0))))
    assert min(Image.open(io.BytesIO(payload)).size) == 20


def test_pack_list_file_with_several_labels(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    (tmp_path / "src" / "my.lst").write_text("7\t1\t0.5\tcat/0.jpg\n9\t0\t2\tdog/4.jpg\n")
    pack_recordio(tmp_path / "src" / "my.lst", tmp_path / "lst.rec", processes=1)
    keys = [line.split("\t")[0] for line in (tmp_path / "lst.idx").read_text().splitlines()]
    assert keys == ["7", "9"]
    records = list(aioloader.Loader(aioloader.RecordIO(str(tmp_path / "lst.rec")),
                                    batch_size=None, num_workers=0))
    header, _ = recordio.unpack(records[0])
    assert header.flag == 2 and header.label.tolist() == [1.0, 0.5] and header.id == 7


def test_pack_tar_shards_of_a_target_size(tmp_path: Path) -> None:
    expected = make_tree(tmp_path / "src")
    shards = pack_tar(tmp_path / "src", tmp_path / "train.tar", processes=2, shard_bytes=4096)
    assert len(shards) > 1 and shards[0].name == "train-000000.tar"
    samples = list(aioloader.Loader(aioloader.TarShards([str(p) for p in shards]),
                                    batch_size=None, num_workers=0))
    assert [int(s["cls"]) for s in samples] == [label for _, label in expected]
    assert samples[0]["jpg"] == (tmp_path / "src" / expected[0][0]).read_bytes()


def test_inspect_reports_counts_labels_and_headers(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    pack_recordio(tmp_path / "src", tmp_path / "out.rec", processes=1)
    report = run_cli("inspect", str(tmp_path / "out.rec"), "--first", "2")
    assert "records: 10" in report and "labels (2 distinct): 0: 5, 1: 5" in report
    assert "IRHeader(flag=0, label=0.0, id=1, id2=0)" in report
    shards = pack_tar(tmp_path / "src", tmp_path / "t.tar", processes=1)
    report = run_cli("inspect", str(shards[0]))
    assert "samples: 10" in report and "jpg x10" in report and "cls x10" in report
