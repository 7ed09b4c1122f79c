"""`aioloader pack` and `aioloader inspect`, run as a user runs them."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aioloader
from aioloader import recordio
from aioloader._tools.packing import ImageOptions, pack_recordio, pack_tar
from aioloader.testing import TestServer

Image = pytest.importorskip("PIL.Image")


def make_tree(root: Path, classes: int = 2, per_class: int = 5) -> list[tuple[str, int]]:
    """Small JPEGs, a folder per class; returns (relative path, label) in ImageFolder order, so
    a record's id indexes this list."""
    expected = []
    for label in range(classes):
        name = ["cat", "dog", "eel", "fox"][label]
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            path = root / name / f"{i}.jpg"
            Image.new("RGB", (40 + i, 30), (label * 60, i * 40, 0)).save(path, quality=90)
            expected.append((f"{name}/{i}.jpg", label))
    return expected


def run_cli(*arguments: str) -> str:
    done = subprocess.run([sys.executable, "-m", "aioloader", *arguments], capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout


def run_failing_cli(*arguments: str) -> str:
    """The last line of stderr, after checking for exit status 2 and no traceback."""
    done = subprocess.run([sys.executable, "-m", "aioloader", *arguments], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    return done.stderr.strip().splitlines()[-1]


def read_records(rec: Path) -> list[tuple[recordio.IRHeader, bytes]]:
    dataset = aioloader.RecordIO(str(rec), str(rec.with_suffix(".idx")))
    return [recordio.unpack(r) for r in aioloader.Loader(dataset, batch_size=None, num_workers=0)]


def test_pack_folder_to_rec_ids_map_records_back_to_their_files(tmp_path: Path) -> None:
    expected = make_tree(tmp_path / "src")
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "out.rec"), "--processes", "2")
    records = read_records(tmp_path / "out.rec")
    assert sorted(header.id for header, _ in records) == list(range(len(expected)))
    for header, payload in records:
        relative, label = expected[header.id]
        assert header.label == label
        assert payload == (tmp_path / "src" / relative).read_bytes()
    keys = [line.split("\t")[0] for line in (tmp_path / "out.idx").read_text().splitlines()]
    assert keys == [str(header.id) for header, _ in records]


def test_pack_shuffles_by_default_so_early_batches_hold_many_classes(tmp_path: Path) -> None:
    make_tree(tmp_path / "src", classes=4, per_class=5)
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "a.rec"), "--processes", "1")
    first_eight = {header.label for header, _ in read_records(tmp_path / "a.rec")[:8]}
    assert len(first_eight) >= 3  # in class order they would be 2
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "b.rec"), "--seed", "0")
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "c.rec"), "--seed", "1")
    assert (tmp_path / "a.rec").read_bytes() == (tmp_path / "b.rec").read_bytes()
    assert (tmp_path / "a.rec").read_bytes() != (tmp_path / "c.rec").read_bytes()


def test_pack_no_shuffle_keeps_the_folder_order(tmp_path: Path) -> None:
    expected = make_tree(tmp_path / "src")
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "out.rec"), "--no-shuffle")
    records = read_records(tmp_path / "out.rec")
    assert [(h.id, h.label) for h, _ in records] == [(n, e[1]) for n, e in enumerate(expected)]


def test_pack_refuses_an_unknown_suffix_unless_format_is_given(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    last = run_failing_cli("pack", str(tmp_path / "src"), str(tmp_path / "out.zip"))
    assert last.startswith("aioloader: error: ") and "--format" in last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "out.zip"), "--format", "tar")
    assert (tmp_path / "out-000000.tar").exists()


@pytest.mark.parametrize("out", ["out.rec", "out.tar", "out.tfrecord"])
def test_a_failed_pack_leaves_no_file_behind(tmp_path: Path, out: str) -> None:
    make_tree(tmp_path / "src")
    (tmp_path / "src" / "dog" / "9.jpg").write_bytes(b"not a jpeg")
    last = run_failing_cli("pack", str(tmp_path / "src"), str(tmp_path / out), "--resize", "20",
                           "--processes", "1")
    assert re.match(r"aioloader: error: .*dog/9\.jpg", last), last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_pack_refuses_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "src" / "cat").mkdir(parents=True)
    assert "no images in" in run_failing_cli("pack", str(tmp_path / "src"), str(tmp_path / "o.rec"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


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
    pack_recordio(tmp_path / "src" / "my.lst", tmp_path / "lst.rec", processes=1, shuffle=False)
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
    assert sorted(int(s["__key__"]) for s in samples) == list(range(len(expected)))
    for sample in samples:  # the key names the file
        relative, label = expected[int(sample["__key__"])]
        assert int(sample["cls"]) == label
        assert sample["jpg"] == (tmp_path / "src" / relative).read_bytes()
    indexes = [p.with_name(p.name + ".index.json") for p in shards]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["src", *(p.name for p in shards), *(p.name for p in indexes)])


def test_packed_tar_indexes_equal_the_ones_made_by_reading_the_shards(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    shards = [str(p) for p in pack_tar(tmp_path / "src", tmp_path / "t.tar", processes=1,
                                       shard_bytes=4096)]
    packed = aioloader.TarShards(shards).starts
    for shard in shards:
        Path(shard + ".index.json").unlink()
    assert aioloader.TarShards(shards, index_dir=tmp_path / "made").starts == packed


def test_inspect_reports_counts_labels_and_headers(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    pack_recordio(tmp_path / "src", tmp_path / "out.rec", processes=1, shuffle=False)
    report = run_cli("inspect", str(tmp_path / "out.rec"), "--first", "2")
    assert "records: 10" in report and "labels (2 distinct): 0: 5, 1: 5" in report
    assert "IRHeader(flag=0, label=0.0, id=1, id2=0)" in report
    shards = pack_tar(tmp_path / "src", tmp_path / "t.tar", processes=1)
    report = run_cli("inspect", str(shards[0]))
    assert "samples: 10" in report and "jpg x10" in report and "cls x10" in report


def test_inspect_reads_urls_and_a_404_is_one_line_at_once(tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    pack_recordio(tmp_path / "src", tmp_path / "out.rec", processes=1)
    (tmp_path / "bare.rec").write_bytes((tmp_path / "out.rec").read_bytes())  # no .idx
    shards = pack_tar(tmp_path / "src", tmp_path / "t.tar", processes=1)
    with TestServer(tmp_path) as server:
        assert "records: 10" in run_cli("inspect", server.url + "out.rec")
        report = run_cli("inspect", server.url + "bare.rec")
        assert "no index" in report and "records: 10" in report
        assert "samples: 10" in run_cli("inspect", server.url + shards[0].name)
        started = time.perf_counter()
        last = run_failing_cli("inspect", server.url + "missing.rec")
        assert time.perf_counter() - started < 20  # a 404 is not retried
        assert re.match(r"aioloader: error: .*missing\.rec.*404", last), last


def test_inspect_refuses_an_unknown_format_and_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "x.zip").write_bytes(b"PK")
    assert "cannot tell the format" in run_failing_cli("inspect", str(tmp_path / "x.zip"))
    assert "no such file" in run_failing_cli("inspect", str(tmp_path / "missing.rec"))


def test_inspect_reads_a_brace_pattern_of_shards_and_shows_labels_as_labels(
    tmp_path: Path,
) -> None:
    make_tree(tmp_path / "src")
    shards = pack_tar(tmp_path / "src", tmp_path / "t.tar", processes=1, shard_bytes=4096)
    pattern = str(tmp_path / f"t-{{000000..{len(shards) - 1:06d}}}.tar")
    report = run_cli("inspect", pattern, "--first", "1")
    assert f"WebDataset tar shards ({len(shards)})" in report and "samples: 10" in report
    first = report.splitlines()[-1]
    assert "jpg: " in first and "bytes" in first and "label " in first and "cls:" not in first


def test_pack_tfrecord_writes_examples_the_reference_reads_and_an_index_beside(
        tmp_path: Path) -> None:
    from tfrecord.reader import tfrecord_loader

    tree = dict(make_tree(tmp_path / "src"))
    run_cli("pack", str(tmp_path / "src"), str(tmp_path / "out.tfrecord"), "--no-shuffle")
    out, index = tmp_path / "out.tfrecord", tmp_path / "out.tfrecord.idx"
    files = sorted(tree)
    theirs = list(tfrecord_loader(str(out), None, {"image/encoded": "byte",
                                                   "image/format": "byte",
                                                   "image/class/label": "int"}))
    ours = list(aioloader.Loader(aioloader.TFRecord(str(out)), decode=aioloader.tfrecord.
                                 parse_example, batch_size=None, num_workers=0))
    assert len(theirs) == len(ours) == len(files)
    for name, their, our in zip(files, theirs, ours, strict=True):
        image = (tmp_path / "src" / name).read_bytes()
        assert bytes(their["image/encoded"]) == our["image/encoded"][0] == image
        assert their["image/class/label"].tolist() == our["image/class/label"].tolist() == [
            tree[name]]
        assert our["image/format"] == [b"jpg"]
    assert len(index.read_text().splitlines()) == len(files)
    summary = run_cli("inspect", str(out), "--first", "2")
    assert f"records: {len(files)}" in summary
    assert "labels (2 distinct): 0: 5, 1: 5" in summary
    assert "image/encoded: bytes x1" in summary and "image/class/label: int64[1]" in summary
