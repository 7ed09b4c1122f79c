"""Corrupt and hostile bytes through the tar and RecordIO parsers.

Whatever the bytes, a parser finishes: it returns, or it raises its format's own error naming
the file and the place. No other exception escapes, nothing hangs (the test timeout turns a
hang into a failure), and nothing allocates what a forged length declares.
"""

from __future__ import annotations

import asyncio
import io
import re
import struct
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from recordio_cases import MAGIC, payloads
from test_tarshards import parse, pax_record

import aioloader
from aioloader import recordio
from aioloader._tar import TarFormatError
from aioloader.recordio import RecordIOError

SHARD = "mutant-000.tar"
REC = "mutant.rec"
IDX = "mutant.idx"
FILES = [
    ("a/one.jpg", b"j" * 700),
    ("a/one.cls", b"1"),
    ("deep/" * 25 + "two.txt", b"a name over 100 bytes"),
    ("\u00fc/drei.txt", b"a name that is not ASCII"),
    ("a/four.seg.png", b""),
]


def tar_shard(format: int) -> bytes:
    """FILES as Python's tarfile writes them: with pax headers (a global one and one per
    member), GNU long names, or ustar name prefixes."""
    pax = {"comment": "global"} if format == tarfile.PAX_FORMAT else None
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format, pax_headers=pax) as tar:
        for name, data in FILES:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if format == tarfile.PAX_FORMAT:
                info.pax_headers = {"comment": f"about {name}"}
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def headers(shard: bytes) -> list[tuple[int, int, bytes]]:
    """(offset, data size, type) of every header block of a well-formed shard."""
    found, offset = [], 0
    while shard[offset : offset + 512].strip(b"\0"):
        info = tarfile.TarInfo.frombuf(shard[offset : offset + 512], "utf-8", "surrogateescape")
        found.append((offset, info.size, info.type))
        offset += 512 + info.size + -info.size % 512
    return found


SHARDS = [tar_shard(f) for f in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT)]
FIELDS = [(0, 100), (100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (156, 1), (157, 100),
          (257, 8), (329, 8), (337, 8), (345, 155)]
"""(offset, length) of the ustar header fields: name, mode, uid, gid, size, mtime, type,
linkname, magic and version, devmajor, devminor, prefix."""
FIELD_VALUES = st.one_of(
    st.binary(min_size=1, max_size=12),
    st.sampled_from([b"0", b"0 ", b"\0", b"-1", b"8", b"77777777777", b"x", b"L", b"K", b"g",
                     b"\xff" * 12, b"\x80" + b"\xff" * 11, b"\x80" + bytes(10) + b"\x01"]),
)
PAX_BYTES = st.lists(st.sampled_from(list(b"0123456789 =\n\0xp")), max_size=4).map(bytes)


def set_checksum(shard: bytearray, offset: int) -> None:
    shard[offset + 148 : offset + 156] = b" " * 8
    shard[offset + 148 : offset + 156] = b"%06o\0 " % sum(shard[offset : offset + 512])


@st.composite
def mutated_shards(draw: st.DrawFn) -> bytes:
    """A valid shard with a few bytes flipped, cut, inserted, header fields overwritten (the
    checksum mostly made right again, so the field is what gets parsed) or pax records
    scribbled on (pax data has no checksum)."""
    base = draw(st.sampled_from(SHARDS))
    blocks = headers(base)
    pax = [(o, n) for o, n, kind in blocks if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE)]
    shard = bytearray(base)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.integers(0, 1 << 20))
        kind = draw(st.sampled_from(["flip", "cut", "insert", "field", "field", "pax", "pax"]))
        if kind == "flip" and shard:
            shard[where % len(shard)] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del shard[where % (len(shard) + 1) :]
        elif kind == "insert":
            at = where % (len(shard) + 1)
            shard[at:at] = draw(st.binary(min_size=1, max_size=600))
        elif kind == "field":
            offset = draw(st.sampled_from(blocks))[0]
            start, length = draw(st.sampled_from(FIELDS))
            value = draw(FIELD_VALUES)[:length]
            at = offset + start + where % (length - len(value) + 1)
            shard[at : at + len(value)] = value
            if draw(st.integers(0, 9)):
                set_checksum(shard, offset)
        elif kind == "pax" and pax:
            offset, size = draw(st.sampled_from(pax))
            at = offset + 512 + where % size
            shard[at : at + 4] = draw(PAX_BYTES)
    return bytes(shard)


def parses_or_refuses(shard: bytes, chunk_size: int) -> None:
    """Parse to the end, or fail with a TarFormatError naming the shard and the place."""
    chunks = [shard[i : i + chunk_size] for i in range(0, len(shard), chunk_size)]
    try:
        parse(chunks, SHARD)
    except TarFormatError as e:
        assert str(e).startswith(f"{SHARD}: ")
        assert " offset " in str(e) or "more than one" in str(e)  # or a key used twice


def test_unmutated_shards_give_every_file() -> None:
    keys = ["a/one", "deep/" * 25 + "two", "\u00fc/drei", "a/four"]
    for shard in SHARDS:
        samples = parse(shard)
        assert [s["__key__"] for s in samples] == keys
        assert samples[0] == {"__key__": "a/one", "__url__": "s.tar", "jpg": FILES[0][1],
                              "cls": b"1"}


@settings(max_examples=300, deadline=None)
@given(shard=mutated_shards(), chunk_size=st.integers(1, 1500))
def test_mutated_tar_shards_parse_or_raise_tar_format_error(shard: bytes, chunk_size: int) -> None:
    parses_or_refuses(shard, chunk_size)


@settings(max_examples=150, deadline=None)
@given(
    records=st.lists(st.one_of(
        st.binary(max_size=30),
        st.builds(pax_record, st.text(max_size=6), st.text(max_size=10)),
    ), max_size=4),
)
def test_arbitrary_pax_records_parse_or_raise_tar_format_error(records: list[bytes]) -> None:
    pax_header = tarfile.TarInfo("././@PaxHeader")
    pax_header.type = tarfile.XHDTYPE
    pax_header.size = len(data := b"".join(records))
    regular = tarfile.TarInfo("k.txt")
    shard = (pax_header.tobuf(tarfile.USTAR_FORMAT) + data + bytes(-len(data) % 512)
             + regular.tobuf(tarfile.USTAR_FORMAT) + bytes(1024))
    parses_or_refuses(shard, 512)


@pytest.mark.timeout(30)
def test_mutated_shard_read_by_the_loader_names_the_shard(tmp_path: Path) -> None:
    """The first file's own pax header gets a record of length zero ("00 comment=...")."""
    shard = bytearray(SHARDS[0])
    record = re.search(rb"(\d+) comment=about", shard)
    assert record is not None
    shard[record.start(1) : record.end(1)] = b"0" * len(record.group(1))
    path = tmp_path / SHARD
    path.write_bytes(shard)
    with pytest.raises(  # found when the shard is indexed, before any epoch
        TarFormatError,
        match=rf"^{re.escape(str(path))}: bad pax header record at offset {record.start()}: ",
    ):
        aioloader.TarShards(str(path))


def with_aligned_magic(body: bytes, cuts: list[int]) -> bytes:
    """`body` with the magic put in at 4-byte-aligned places, so it is written in parts."""
    for cut in sorted(cuts, reverse=True):
        at = min(4 * cut, len(body) // 4 * 4)
        body = body[:at] + MAGIC + body[at:]
    return body


PAYLOADS = st.one_of(
    st.sampled_from(payloads()),
    st.builds(with_aligned_magic, st.binary(max_size=40), st.lists(st.integers(0, 10), max_size=3)),
)
LENGTH_WORDS = st.builds(
    lambda flag, length: struct.pack("<I", flag << 29 | length),
    st.integers(0, 7),
    st.one_of(st.integers(0, 64), st.sampled_from([recordio.MAX_LENGTH, 1 << 28]),
              st.integers(0, recordio.MAX_LENGTH)),
)


@st.composite
def mutated_rec_files(draw: st.DrawFn) -> bytes:
    """Records as dmlc-core writes them, then bytes flipped, cut or inserted, part headers'
    length words forged or a magic put down at an aligned place."""
    data = bytearray(b"".join(recordio.encode(p) for p in draw(st.lists(PAYLOADS, max_size=4))))
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.integers(0, 1 << 20))
        kind = draw(st.sampled_from(["flip", "cut", "insert", "length", "magic"]))
        if kind == "flip" and data:
            data[where % len(data)] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[where % (len(data) + 1) :]
        elif kind == "insert":
            at = where % (len(data) + 1)
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif kind in ("length", "magic") and len(data) >= 8:
            at = where % (len(data) // 4) * 4
            data[at : at + 4] = draw(LENGTH_WORDS) if kind == "length" else MAGIC
    return bytes(data)


def refused(error: RecordIOError, name: str) -> None:
    assert str(error).startswith(f"{name}: ")
    assert " offset " in str(error) or " line " in str(error), str(error)


def decodes_or_refuses(data: bytes, offset: int = 0) -> None:
    try:
        payload, used = recordio.decode(data, REC, offset)
    except RecordIOError as e:
        refused(e, REC)
    else:
        assert 8 <= used <= len(data) and len(payload) <= used


@settings(max_examples=300, deadline=None)
@given(data=mutated_rec_files(), start=st.integers(0, 200))
def test_mutated_records_decode_or_raise_recordio_error(data: bytes, start: int) -> None:
    decodes_or_refuses(data)
    starts = []
    try:
        for position in recordio.record_starts(data, start, REC):
            starts.append(position)
    except RecordIOError as e:
        refused(e, REC)
    assert all(s % 4 == 0 and s >= start for s in starts) and starts == sorted(set(starts))
    for position in starts:
        decodes_or_refuses(data[position:], position)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def fetch_all(dataset: aioloader.RecordIO) -> list[bytes | RecordIOError]:
    """Every record's payload, or the RecordIOError fetching it raised."""

    async def fetch(index: int) -> bytes | RecordIOError:
        try:
            return await dataset.fetch(index)
        except RecordIOError as e:
            return e

    async def run() -> list[bytes | RecordIOError]:
        return list(await asyncio.gather(*(fetch(i) for i in range(len(dataset)))))

    return asyncio.run(run())


def opens_or_refuses(name: str, *args: Any) -> aioloader.RecordIO | None:
    """The dataset, or None when opening it raised a RecordIOError naming `name`."""
    try:
        return aioloader.RecordIO(*args)
    except RecordIOError as e:
        refused(e, name)
        return None


@settings(max_examples=150, deadline=None)
@given(data=mutated_rec_files(), parts=st.integers(1, 3))
def test_scanning_a_mutated_rec_file_indexes_it_or_raises(
    folder: Path, data: bytes, parts: int
) -> None:
    """Records the scan accepts all decode: it checks what decode checks."""
    path = folder / REC
    path.write_bytes(data)
    for part in range(parts):
        dataset = opens_or_refuses(str(path), str(path), None, parts, part)
        if dataset is not None and parts == 1:
            assert fetch_all(dataset) == [
                recordio.decode(data[s:])[0] for s in recordio.record_starts(data)
            ]


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_index_bytes_are_read_or_refused(raw: bytes) -> None:
    try:
        keys, offsets = recordio.read_index(raw, IDX)
    except RecordIOError as e:
        refused(e, IDX)
    else:
        assert len(keys) == len(offsets) and all(o >= 0 for o in offsets)


INDEX_LINES = st.lists(
    st.builds(
        lambda key, sep, offset: f"{key}{sep}{offset}",
        st.text(max_size=6),
        st.sampled_from(["\t", "\t", " ", "\t\t", ""]),
        st.one_of(st.integers(-3, 1 << 70).map(str), st.text(max_size=6)),
    ),
    max_size=8,
).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(text=INDEX_LINES)
def test_random_index_lines_are_read_or_refused(text: str) -> None:
    try:
        keys, offsets = recordio.read_index(text, IDX)
    except RecordIOError as e:
        refused(e, IDX)
    else:
        assert len(keys) == len(offsets) and all(o >= 0 for o in offsets)


GOLDEN_REC = Path(__file__).parent / "data" / "golden.rec"
GOLDEN_STARTS = list(recordio.record_starts(GOLDEN_REC.read_bytes()))


@settings(max_examples=60, deadline=None)
@given(
    offsets=st.lists(
        st.one_of(st.sampled_from(GOLDEN_STARTS), st.integers(-10, 2 * GOLDEN_STARTS[-1])),
        max_size=6,
    ),
)
def test_a_dataset_with_a_forged_index_opens_or_names_the_index(
    folder: Path, offsets: list[int]
) -> None:
    """Errors found opening it name the index; a record it points into the middle of is found
    only when fetched, and then the error names the .rec file."""
    idx = folder / IDX
    idx.write_text("".join(f"{n}\t{o}\n" for n, o in enumerate(offsets)))
    dataset = opens_or_refuses(str(idx), str(GOLDEN_REC), str(idx))
    if dataset is not None:
        for result in fetch_all(dataset):
            if isinstance(result, RecordIOError):
                refused(result, str(GOLDEN_REC))


@settings(max_examples=300, deadline=None)
@given(
    record=st.one_of(
        st.binary(max_size=64),
        st.builds(
            lambda flag, rest: struct.pack("<I", flag) + rest,
            st.sampled_from([0, 1, 2, 3, 1000, 2**31, 2**32 - 1]),
            st.binary(max_size=64),
        ),
    ),
)
def test_random_image_record_headers_unpack_or_raise_recordio_error(record: bytes) -> None:
    try:
        header, payload = recordio.unpack(record, REC)
    except RecordIOError as e:
        assert str(e).startswith(f"{REC}: ")
    else:
        assert len(payload) <= len(record) - 24
        if header.flag > 0:
            assert len(header.label) == header.flag
