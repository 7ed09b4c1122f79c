"""TFRecord against a reference: the `tfrecord` package, which reimplements TensorFlow's
framing, masked CRC-32C and `tf.train.Example` (with protobuf) and DALI's index format, so that
the suite does not install TensorFlow (1.5 GB). Files it writes are read here, and files
written here are read by it; both ways over local disk, nginx, the test server and S3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tfrecord.reader import tfrecord_loader
from tfrecord.tools.tfrecord2idx import create_index
from tfrecord.writer import TFRecordWriter

import aioloader
from aioloader import tfrecord
from aioloader.testing import TestServer

from conftest import Nginx


def reference_features(n: int) -> dict[str, tuple[Any, str]]:
    """Record n as the `tfrecord` package writes it: bytes, floats and ints, some negative."""
    return {"image": (bytes([n % 256]) * (100 + n), "byte"),
            "label": ([n, -n, 2**40 + n], "int"),
            "weights": ([0.5 * n, -1.25], "float")}


def write_reference(path: Path, count: int, first: int = 0) -> None:
    writer = TFRecordWriter(str(path))
    for n in range(first, first + count):
        writer.write(reference_features(n))
    writer.close()


def as_ours(n: int) -> dict[str, Any]:
    """Record n as `tfrecord.parse_example` gives it."""
    return {"image": [bytes([n % 256]) * (100 + n)],
            "label": np.array([n, -n, 2**40 + n], np.int64),
            "weights": np.array([0.5 * n, -1.25], np.float32)}


def same(parsed: dict[str, Any], expected: dict[str, Any]) -> bool:
    return parsed.keys() == expected.keys() and all(
        (np.array_equal(parsed[k], v) and parsed[k].dtype == v.dtype)
        if isinstance(v, np.ndarray) else parsed[k] == v for k, v in expected.items())


def parsed_record(raw: bytes) -> dict[str, Any]:
    return tfrecord.parse_example(raw)


def number_of(raw: bytes) -> int:
    return int(tfrecord.parse_example(raw)["label"][0])


def test_records_the_reference_writes_read_alike_with_its_index_with_ours_and_without(
        tmp_path: Path) -> None:
    path = tmp_path / "ref.tfrecord"
    write_reference(path, 50)
    create_index(str(path), str(tmp_path / "ref.index"))
    for dataset in (aioloader.TFRecord(str(path), str(tmp_path / "ref.index")),
                    aioloader.TFRecord(str(path), index_dir=tmp_path / "kept")):
        records = list(aioloader.Loader(dataset, decode=parsed_record, batch_size=None,
                                        num_workers=0))
        assert len(records) == 50
        assert all(same(r, as_ours(n)) for n, r in enumerate(records))
    # the scan's index is kept, in DALI's format: the reference's own, line for line
    kept = list((tmp_path / "kept").iterdir())
    assert [p.read_text() for p in kept] == [(tmp_path / "ref.index").read_text()]


def test_records_written_here_read_alike_by_the_reference(tmp_path: Path) -> None:
    path, index = tmp_path / "ours.tfrecord", tmp_path / "ours.idx"
    with tfrecord.Writer(path, index) as writer:
        for n in range(40):
            writer.write(tfrecord.example({"image": bytes([n]) * (100 + n),
                                           "label": [n, -n, 2**40 + n],
                                           "weights": np.array([0.5 * n, -1.25])}))
    create_index(str(path), str(tmp_path / "theirs.idx"))
    assert index.read_text() == (tmp_path / "theirs.idx").read_text()
    theirs = list(tfrecord_loader(str(path), str(index),
                                  {"image": "byte", "label": "int", "weights": "float"}))
    theirs.sort(key=lambda record: int(record["label"][0]))  # with an index it starts elsewhere
    assert len(theirs) == 40
    for n, record in enumerate(theirs):
        assert bytes(record["image"]) == bytes([n]) * (100 + n)
        assert record["label"].tolist() == [n, -n, 2**40 + n]
        assert record["weights"].tolist() == [0.5 * n, -1.25]


def test_a_damaged_record_names_the_file_the_offset_and_which_crc(tmp_path: Path) -> None:
    path = tmp_path / "bad.tfrecord"
    write_reference(path, 3)
    data = bytearray(path.read_bytes())
    second = tfrecord.record_size(bytes(data))
    data[second + 20] ^= 0xFF  # in the second record's data
    path.write_bytes(bytes(data))
    loader = aioloader.Loader(aioloader.TFRecord(str(path), index_dir=tmp_path / "i"),
                              batch_size=None, num_workers=0)
    with pytest.raises(aioloader.SampleError, match=rf"sample 1 .*bad\.tfrecord: bad record at "
                                                    rf"offset {second}: the CRC of its \d+ "
                                                    "bytes of data does not match"):
        list(loader)
    path.write_bytes(bytes(data[: second + 5]))  # cut inside the second record's header
    with pytest.raises(tfrecord.TFRecordError, match=rf"truncated record at offset {second}"):
        aioloader.TFRecord(str(path), index_dir=tmp_path / "j")
    path.write_bytes(b"\x1f\x8b" + bytes(100))
    with pytest.raises(tfrecord.TFRecordError, match=r"bad\.tfrecord: the gzip stream is "
                                                     "damaged"):
        aioloader.TFRecord(str(path), index_dir=tmp_path / "k")


def test_an_index_of_another_file_is_refused_naming_both(tmp_path: Path) -> None:
    write_reference(tmp_path / "a.tfrecord", 5)
    (tmp_path / "a.tfrecord.idx").write_text("0 200\n200 9999\n")
    with pytest.raises(tfrecord.TFRecordError, match=r"a\.tfrecord\.idx: the record at offset "
                                                     r"200 .* does not fit .*a\.tfrecord"):
        aioloader.TFRecord(str(tmp_path / "a.tfrecord"))


def test_over_nginx_the_test_server_and_s3_each_batch_is_few_requests(
        nginx: Nginx, web_root: Path, s3_endpoint: str) -> None:
    """Neighbouring records of a batch are one ranged request; an index beside the file is
    found and used, over every store."""
    boto3 = pytest.importorskip("boto3")
    folder = web_root / "tfrecords"
    folder.mkdir()
    for n in range(2):
        write_reference(folder / f"part-{n}.tfrecord", 40, first=40 * n)
        create_index(str(folder / f"part-{n}.tfrecord"), str(folder / f"part-{n}.tfrecord.idx"))
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="tfrecords")
    for path in folder.iterdir():
        client.put_object(Bucket="tfrecords", Key=path.name, Body=path.read_bytes())
    names = ["part-0.tfrecord", "part-1.tfrecord"]
    with TestServer(folder) as server:
        for base in (nginx.url + "tfrecords/", server.url, "s3://tfrecords/"):
            loader = aioloader.Loader(aioloader.TFRecord([base + n for n in names]),
                                      decode=number_of, batch_size=8, num_workers=0)
            assert [int(x) for batch in loader for x in batch] == list(range(80))
            assert loader.stats.requests <= 10  # a batch's 8 records in one request at most


def resumed_on_three(dataset: aioloader.Dataset | aioloader.Stream
                     ) -> tuple[list[int], list[int]]:
    """What 2 ranks took in 5 steps each, and what 3 ranks resumed from rank 0's state took."""

    def loader(rank: int, world_size: int) -> aioloader.Loader:
        return aioloader.Loader(dataset, decode=number_of, batch_size=4, shuffle=True, seed=3,
                                num_workers=0, rank=rank, world_size=world_size)

    before, states = [], []
    for rank in range(2):
        two = loader(rank, 2)
        for step, batch in enumerate(two, 1):
            before += batch.tolist()
            if step == 5:
                states.append(two.state_dict())
                break
    after = []
    for rank in range(3):
        three = loader(rank, 3)
        three.load_state_dict(states[0])
        after += [x for batch in three for x in batch.tolist()]
    return before, after


def test_an_epoch_resumes_on_another_world_size_with_every_record_once(tmp_path: Path) -> None:
    write_reference(tmp_path / "r.tfrecord", 101)
    before, after = resumed_on_three(
        aioloader.TFRecord(str(tmp_path / "r.tfrecord"), index_dir=tmp_path / "i"))
    assert len(before) == 40 and len(before) + len(after) - 101 < 3  # repeats only to pad
    assert set(before) | set(after) == set(range(101)) and len(set(before) & set(after)) < 3


def gzipped_reference(path: Path, count: int, first: int = 0) -> None:
    """A file as TensorFlow's writer makes it with compression_type="GZIP": the framed
    records, one gzip stream."""
    import gzip

    write_reference(path, count, first)
    path.write_bytes(gzip.compress(path.read_bytes()))


def test_gzip_files_stream_as_the_reference_reads_them_and_their_index_is_kept(
        tmp_path: Path) -> None:
    """TFRecordStream reads what tf.data reads with compression_type="GZIP", and plain files
    beside them; the map-style TFRecord names it for a compressed file."""
    gzipped_reference(tmp_path / "a.tfrecord", 30)
    write_reference(tmp_path / "b.tfrecord", 20, first=30)
    reference = list(tfrecord_loader(str(tmp_path / "a.tfrecord"), None,
                                     compression_type="gzip"))
    assert [int(r["label"][0]) for r in reference] == list(range(30))
    urls = [str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")]
    stream = aioloader.TFRecordStream(urls, index_dir=tmp_path / "i")
    assert stream.compressions == ["gzip", None]
    assert [p.name.endswith(".gzip.idx") for p in sorted((tmp_path / "i").rglob("*.idx"),
                                                         key=lambda p: p.stat().st_size)] == \
        [False, True]  # b's 20 records, then a's 30
    loader = aioloader.Loader(stream, decode=parsed_record, batch_size=None, num_workers=0)
    got = list(loader)
    assert len(got) == 50 and all(same(p, as_ours(n)) for n, p in enumerate(got))
    assert aioloader.TFRecordStream(urls, index_dir=tmp_path / "i").unit_sizes.tolist() == \
        [30, 20]
    with pytest.raises(tfrecord.TFRecordError, match=r"a\.tfrecord: a gzip-compressed "
                                                     r"TFRecord file .*TFRecordStream"):
        aioloader.TFRecord(urls, index_dir=tmp_path / "i")
    data = (tmp_path / "a.tfrecord").read_bytes()
    (tmp_path / "cut.tfrecord").write_bytes(data[:-20])
    with pytest.raises(tfrecord.TFRecordError, match=r"cut\.tfrecord: the gzip stream ends"):
        aioloader.TFRecordStream(str(tmp_path / "cut.tfrecord"), index_dir=tmp_path / "i")


def test_a_gzip_file_over_every_store_divides_by_records_and_is_read_once_a_pass(
        tmp_path: Path, nginx: Nginx, web_root: Path, s3_endpoint: str) -> None:
    """Ranks of any world size get as many records each, every record once; a rank reads
    each compressed file it has a share of with one request a pass, over nginx, the test
    server and S3."""
    boto3 = pytest.importorskip("boto3")
    folder = web_root / "gzipped-tfrecords"
    folder.mkdir()
    names = [f"part-{n}.tfrecord" for n in range(3)]
    for n, name in enumerate(names):
        gzipped_reference(folder / name, 100, first=100 * n)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="gzipped")
    for name in names:
        client.put_object(Bucket="gzipped", Key=name, Body=(folder / name).read_bytes())
    with TestServer(folder) as server:
        for base in (server.url, nginx.url + "gzipped-tfrecords/", "s3://gzipped/"):
            stream = aioloader.TFRecordStream([base + n for n in names], shuffle_buffer=16,
                                              index_dir=tmp_path / "i")
            for world_size in (1, 2, 3):
                shares = []
                for rank in range(world_size):
                    loader = aioloader.Loader(stream, decode=number_of, batch_size=5,
                                              shuffle=True, num_workers=0, rank=rank,
                                              world_size=world_size)
                    shares.append([x for batch in loader for x in batch.tolist()])
                    if base == server.url:
                        assert loader.stats.requests <= len(names)
                assert sorted(x for share in shares for x in share) == list(range(300))
                assert {len(share) for share in shares} == {300 // world_size}


def test_a_streamed_epoch_resumes_on_another_world_size_with_every_record_once(
        tmp_path: Path) -> None:
    for n in range(2):
        gzipped_reference(tmp_path / f"r{n}.tfrecord", 51, first=51 * n)
    before, after = resumed_on_three(aioloader.TFRecordStream(
        [str(tmp_path / f"r{n}.tfrecord") for n in range(2)], shuffle_buffer=8,
        index_dir=tmp_path / "i"))
    assert len(before) == 40 and len(before) + len(after) - 102 < 3  # repeats only to pad
    assert set(before) | set(after) == set(range(102))
