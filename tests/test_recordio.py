"""MXNet RecordIO: byte vectors, MXNet's own files, reads from disk, nginx and the test server."""

from __future__ import annotations

import asyncio
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recordio_cases import IMAGE_HEADERS, MAGIC, payloads

import aioloader
from aioloader import recordio
from aioloader.recordio import IRHeader, RecordIOError
from aioloader.testing import Nginx, TestServer

DATA = Path(__file__).parent / "data"
GOLDEN = [*payloads(), *(recordio.pack(IRHeader(*h), p) for h, p in IMAGE_HEADERS)]


def read_all(dataset: aioloader.RecordIO) -> list[bytes]:
    async def fetch_all() -> list[bytes]:
        return list(await asyncio.gather(*(dataset.fetch(i) for i in range(len(dataset)))))

    return asyncio.run(fetch_all())


def test_image_header_packs_to_the_known_bytes() -> None:
    packed = recordio.pack(IRHeader(0, 14.0, 20129312, 0), b"")
    assert packed.hex() == "00000000" "00006041" "2026330100000000" "0000000000000000"


def test_pack_unpack_with_one_label_and_with_a_label_array() -> None:
    header, payload = recordio.unpack(recordio.pack(IRHeader(0, 3.0, 5, 6), b"img"))
    assert header == IRHeader(0, 3.0, 5, 6) and payload == b"img"
    header, payload = recordio.unpack(recordio.pack(IRHeader(0, [1.0, 2.5], 7, 0), b"img"))
    assert header.flag == 2 and header.label.tolist() == [1.0, 2.5] and payload == b"img"


def test_writer_is_byte_identical_to_mxnet(tmp_path: Path) -> None:
    with recordio.Writer(tmp_path / "x.rec", tmp_path / "x.idx") as writer:
        for record in GOLDEN:
            writer.write(record)
    assert (tmp_path / "x.rec").read_bytes() == (DATA / "golden.rec").read_bytes()
    assert (tmp_path / "x.idx").read_text() == (DATA / "golden.idx").read_text()


def test_split_record_framing_leaves_the_aligned_magic_out() -> None:
    framed = recordio.encode(b"1234" + MAGIC + b"tail")
    # part 1: 4 bytes, flag 1; part 2: 4 bytes, flag 3; no magic inside the data
    assert framed == (
        MAGIC + (1 << 29 | 4).to_bytes(4, "little") + b"1234"
        + MAGIC + (3 << 29 | 4).to_bytes(4, "little") + b"tail"
    )
    assert recordio.encode(b"12" + MAGIC)[8:] == b"12" + MAGIC + b"\0\0"  # unaligned: kept


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=64),
    cuts=st.lists(st.integers(0, 64), max_size=4),
)
def test_round_trip_with_magic_anywhere(body: bytes, cuts: list[int]) -> None:
    payload = body
    for cut in sorted(cuts, reverse=True):
        cut = min(cut, len(payload))
        payload = payload[:cut] + MAGIC + payload[cut:]
    framed = recordio.encode(payload)
    assert len(framed) % 4 == 0
    assert recordio.decode(framed) == (payload, len(framed))
    assert list(recordio.record_starts(framed)) == [0]


def test_records_of_2_to_the_29_bytes_are_refused() -> None:
    with pytest.raises(ValueError, match="2\\^29"):
        recordio.encode(bytes(1 << 29))


@pytest.mark.parametrize("with_index", [True, False])
def test_reads_mxnet_files_from_disk(with_index: bool) -> None:
    dataset = aioloader.RecordIO(
        str(DATA / "golden.rec"), str(DATA / "golden.idx") if with_index else None
    )
    assert len(dataset) == len(GOLDEN)
    assert read_all(dataset) == GOLDEN


@pytest.mark.parametrize("with_index", [True, False])
def test_reads_the_same_records_over_nginx(nginx: Nginx, web_root: Path, with_index: bool) -> None:
    shutil.copy(DATA / "golden.rec", web_root / "golden.rec")
    shutil.copy(DATA / "golden.idx", web_root / "golden.idx")
    dataset = aioloader.RecordIO(
        nginx.url + "golden.rec", nginx.url + "golden.idx" if with_index else None
    )
    assert read_all(dataset) == GOLDEN


def test_each_fetch_is_one_ranged_read_and_neighbours_are_merged(tmp_path: Path) -> None:
    shutil.copy(DATA / "golden.rec", tmp_path / "golden.rec")
    shutil.copy(DATA / "golden.idx", tmp_path / "golden.idx")
    with TestServer(tmp_path) as server:
        dataset = aioloader.RecordIO(server.url + "golden.rec", server.url + "golden.idx")
        setup = server.stats()["requests"]  # HEAD + the index
        assert asyncio.run(dataset.fetch(3)) == GOLDEN[3]
        assert server.stats()["ranges"] == 1
        loader = aioloader.Loader(dataset, batch_size=16, num_workers=0)
        assert [r for batch in loader for r in batch] == GOLDEN
        assert server.stats()["requests"] == setup + 2  # one read for all 16 neighbours


@pytest.mark.parametrize("files", [1, 2, 3])
@pytest.mark.parametrize("with_index", [True, False])
def test_splits_cover_every_record_exactly_once(files: int, with_index: bool) -> None:
    recs = [str(DATA / "golden.rec")] * files
    idxs = [str(DATA / "golden.idx")] * files if with_index else None
    for parts in range(1, 8):
        seen: list[bytes] = []
        sizes = []
        for part in range(parts):
            dataset = aioloader.RecordIO(recs, idxs, num_parts=parts, part_index=part)
            sizes.append(len(dataset))
            seen += read_all(dataset)
        assert seen == GOLDEN * files, (parts, sizes)


def test_split_parts_are_near_equal_in_bytes(tmp_path: Path) -> None:
    with recordio.Writer(tmp_path / "a.rec") as writer:
        for i in range(1000):
            writer.write(np.random.default_rng(i).bytes(100 + i % 50))
    with recordio.Writer(tmp_path / "b.rec") as writer:
        for _ in range(10):
            writer.write(bytes(1000))
    parts = [aioloader.RecordIO([str(tmp_path / "a.rec"), str(tmp_path / "b.rec")], num_parts=3,
                                part_index=p) for p in range(3)]
    byte_counts = [sum(len(r) for r in read_all(p)) for p in parts]
    assert max(byte_counts) - min(byte_counts) < 0.02 * sum(byte_counts)


def test_bad_magic_names_the_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "bad.rec"
    path.write_bytes(b"this is not a recordio file at all")
    with pytest.raises(RecordIOError, match=r"bad\.rec: bad magic at offset 0: expected 0xced"):
        aioloader.RecordIO(str(path))


def test_truncated_record_is_reported(tmp_path: Path) -> None:
    data = (DATA / "golden.rec").read_bytes()
    path = tmp_path / "cut.rec"
    path.write_bytes(data[:-20])
    with pytest.raises(RecordIOError, match=r"cut\.rec: truncated record at offset"):
        aioloader.RecordIO(str(path))
    shutil.copy(DATA / "golden.idx", tmp_path / "cut.idx")
    dataset = aioloader.RecordIO(str(path), str(tmp_path / "cut.idx"))
    with pytest.raises(RecordIOError, match="truncated record"):
        read_all(dataset)


def test_index_pointing_nowhere_is_reported(tmp_path: Path) -> None:
    (tmp_path / "far.idx").write_text("0\t0\n1\t99999\n")
    with pytest.raises(RecordIOError, match=r"far\.idx: key 1 points to offset 99999, outside"):
        aioloader.RecordIO(str(DATA / "golden.rec"), str(tmp_path / "far.idx"))
    (tmp_path / "mid.idx").write_text("0\t0\n1\t12\n")
    dataset = aioloader.RecordIO(str(DATA / "golden.rec"), str(tmp_path / "mid.idx"))
    with pytest.raises(RecordIOError, match=r"golden\.rec: bad magic at offset 12"):
        read_all(dataset)


def test_reading_from_the_middle_of_a_split_record_is_reported() -> None:
    framed = recordio.encode(b"1234" + MAGIC + b"tail")
    with pytest.raises(RecordIOError, match=r"x\.rec: at offset 112 expected the start of a rec"):
        recordio.decode(framed[12:], "x.rec", 112)


def test_loader_skips_corrupt_records_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "mid.idx").write_text("0\t0\n1\t12\n2\t20\n")
    dataset = aioloader.RecordIO(str(DATA / "golden.rec"), str(tmp_path / "mid.idx"))
    with pytest.raises(aioloader.LoaderError, match="sample 1"):
        list(aioloader.Loader(dataset, batch_size=None, num_workers=0))
    loader = aioloader.Loader(dataset, batch_size=None, num_workers=0, on_error="skip")
    assert len(list(loader)) == 2 and loader.stats.skipped == 1


def record_header(flag: int, length: int) -> bytes:
    return recordio.HEADER.pack(recordio.MAGIC, flag << 29 | length)


@pytest.mark.parametrize(
    ("record", "cause"),
    [
        (b"", "too short for an image record header: 0 bytes"),
        (bytes(23), "too short for an image record header: 23 bytes"),
        (struct.pack("<IfQQ", 1000, 0, 1, 2) + b"x" * 40, "says 1000 float32 labels"),
        (struct.pack("<IfQQ", 2, 0, 1, 2) + b"1234567", "says 2 float32 labels"),
    ],
)
def test_unpack_of_a_short_record_raises_recordio_error(record: bytes, cause: str) -> None:
    with pytest.raises(RecordIOError, match=f"^record: .*{cause}"):
        recordio.unpack(record)
    with pytest.raises(RecordIOError, match=f"^x.rec#7: .*{cause}"):
        recordio.unpack(record, "x.rec#7")


def test_non_utf8_index_names_the_file_and_byte_offset(tmp_path: Path) -> None:
    (tmp_path / "latin.idx").write_bytes(b"0\t0\nk\xe9\t12\n")
    with pytest.raises(RecordIOError, match=r"latin\.idx: not UTF-8 at byte offset 5 \(line 2\)"):
        aioloader.RecordIO(str(DATA / "golden.rec"), str(tmp_path / "latin.idx"))


@pytest.mark.parametrize(
    "line",
    ["just-a-key", "k\t12\t13", "k\t", "k\t-12", "k\t1_2", "k\t+12", "k\t\u0661\u0662", "k\t0x10"],
)
def test_malformed_index_line_names_the_file_and_line(tmp_path: Path, line: str) -> None:
    (tmp_path / "bad.idx").write_text(f"0\t0\n\n{line}\n")
    with pytest.raises(RecordIOError, match=r"bad\.idx: line 3 is not 'key<TAB>offset'"):
        aioloader.RecordIO(str(DATA / "golden.rec"), str(tmp_path / "bad.idx"))


def test_index_accepts_crlf_line_ends_and_blank_lines() -> None:
    assert recordio.read_index("a\t0\r\n\r\nb\t16\r\n", "x.idx") == (["a", "b"], [0, 16])


def test_duplicate_offsets_in_an_index_name_the_index(tmp_path: Path) -> None:
    (tmp_path / "dup.idx").write_text("0\t0\n1\t16\n2\t0\n")
    with pytest.raises(RecordIOError, match=r"dup\.idx: keys \d and \d both point to offset 0"):
        aioloader.RecordIO(str(DATA / "golden.rec"), str(tmp_path / "dup.idx"))


def test_record_starts_names_the_file_and_offset_of_bad_magic() -> None:
    data = recordio.encode(b"abcd") + b"junkjunk" + recordio.encode(b"efgh")
    with pytest.raises(RecordIOError, match=r"^x\.rec: bad magic at offset 12: expected 0xced"):
        list(recordio.record_starts(data, where="x.rec"))


def test_record_starts_refuses_a_broken_part_sequence() -> None:
    data = record_header(recordio.FIRST, 4) + b"1234" + recordio.encode(b"whole")
    with pytest.raises(RecordIOError, match=r"^x\.rec: at offset 12 expected a continuation part"):
        list(recordio.record_starts(data, where="x.rec"))


def test_scan_refuses_a_forged_length_at_its_header(tmp_path: Path) -> None:
    path = tmp_path / "forged.rec"
    first = recordio.encode(b"a good record")
    path.write_bytes(first + record_header(recordio.WHOLE, recordio.MAX_LENGTH) + bytes(3 << 20))
    with pytest.raises(
        RecordIOError,
        match=rf"forged\.rec: truncated record at offset {len(first)}: its header says "
        rf"{recordio.MAX_LENGTH} bytes, the file has {3 << 20} after it",
    ):
        aioloader.RecordIO(str(path))


def test_decode_of_a_forged_length_does_not_allocate_it() -> None:
    data = record_header(recordio.WHOLE, recordio.MAX_LENGTH) + bytes(1000)
    tracemalloc.start()
    try:
        with pytest.raises(RecordIOError, match="header says 536870911 bytes, 1000 remain"):
            recordio.decode(data, "x.rec")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_scan_refuses_a_file_that_begins_inside_a_record(tmp_path: Path) -> None:
    path = tmp_path / "x.rec"
    path.write_bytes(record_header(recordio.MIDDLE, 4) + b"1234" + recordio.encode(b"whole"))
    with pytest.raises(RecordIOError, match=r"x\.rec: at offset 0 expected the start of a rec"):
        aioloader.RecordIO(str(path))


@pytest.mark.parametrize(
    ("tail", "error"),
    [
        (b"\0\0\0\0", "truncated record at offset 16: expected an 8-byte header, 4 bytes"),
        (record_header(recordio.FIRST, 4) + b"1234", "truncated record at offset 16: the file"),
    ],
)
def test_scan_refuses_a_file_that_ends_inside_a_record(
    tmp_path: Path, tail: bytes, error: str
) -> None:
    path = tmp_path / "x.rec"
    path.write_bytes(recordio.encode(b"whole") + tail)
    with pytest.raises(RecordIOError, match=rf"x\.rec: {error}"):
        aioloader.RecordIO(str(path))
