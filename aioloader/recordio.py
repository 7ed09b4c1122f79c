"""MXNet / dmlc-core RecordIO, byte for byte: framing, the image header, `.idx` files, a writer.

A record on disk is one or more parts, each `[u32 magic][u32 cflag << 29 | length][data]`,
little-endian. A payload that holds the magic at a 4-byte-aligned offset is cut there: the magic
is left out and the pieces are written as parts with cflag 1 (first), 2 (middle) and 3 (last);
a record without one is a single part with cflag 0. Zero padding after the last part brings the
record to a multiple of 4 bytes. This is dmlc-core's `RecordIOWriter::WriteRecord`.
"""

from __future__ import annotations

import numbers
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ._closing import Closing
from ._errors import LoaderError

__all__ = [
    "FIRST",
    "HEADER",
    "LAST",
    "MAGIC",
    "MAGIC_BYTES",
    "MAX_LENGTH",
    "MIDDLE",
    "WHOLE",
    "IRHeader",
    "RecordIOError",
    "Writer",
    "decode",
    "encode",
    "pack",
    "read_index",
    "record_starts",
    "unpack",
]

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)
MAX_LENGTH = (1 << 29) - 1
HEADER = struct.Struct("<II")
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3
_IR_FORMAT = struct.Struct("<IfQQ")


class RecordIOError(LoaderError):
    """A .rec or .idx file is not what it should be; names the file, the offset and the cause."""


class IRHeader(NamedTuple):
    """MXNet's image record header: `flag` > 0 means that many float32 labels follow it."""

    flag: int
    label: Any
    id: int
    id2: int


def pack(header: IRHeader | tuple[Any, ...], payload: bytes) -> bytes:
    """Header + payload as MXNet's `recordio.pack` builds it (a label array goes after it)."""
    header = IRHeader(*header)
    if isinstance(header.label, numbers.Number):
        header = header._replace(flag=0)
    else:
        labels = np.asarray(header.label, dtype=np.float32)
        header = header._replace(flag=labels.size, label=0)
        payload = labels.tobytes() + payload
    return _IR_FORMAT.pack(*header) + payload


def unpack(record: bytes, where: str = "record") -> tuple[IRHeader, bytes]:
    """The inverse of `pack`: with flag > 0 the label is a float32 array of that length.

    `where` only makes error messages name the record.
    """
    if len(record) < _IR_FORMAT.size:
        raise RecordIOError(
            f"{where}: too short for an image record header: {len(record)} bytes, "
            f"the header alone takes {_IR_FORMAT.size}"
        )
    header = IRHeader(*_IR_FORMAT.unpack_from(record))
    payload = record[_IR_FORMAT.size :]
    if header.flag > 0:
        if len(payload) < 4 * header.flag:
            raise RecordIOError(
                f"{where}: the image record header says {header.flag} float32 labels "
                f"({4 * header.flag} bytes) follow it, but only {len(payload)} bytes do"
            )
        labels: npt.NDArray[np.float32] = np.frombuffer(payload, np.float32, header.flag)
        header = header._replace(label=labels)
        payload = payload[header.flag * 4 :]
    return header, payload


def _pad(length: int) -> int:
    return -length % 4


def encode(payload: bytes) -> bytes:
    """The bytes dmlc-core writes for one record."""
    if len(payload) > MAX_LENGTH:
        raise ValueError(
            f"a RecordIO record holds at most 2^29 - 1 bytes; this one has {len(payload)}"
        )
    parts = []
    start = 0
    aligned_end = len(payload) // 4 * 4
    found = payload.find(MAGIC_BYTES, 0, aligned_end)
    while found != -1:
        if found % 4 == 0:
            flag = FIRST if start == 0 else MIDDLE
            parts.append(HEADER.pack(MAGIC, flag << 29 | (found - start)) + payload[start:found])
            start = found + 4
        found = payload.find(MAGIC_BYTES, found + 1, aligned_end)
    flag = LAST if start else WHOLE
    tail = len(payload) - start
    parts.append(HEADER.pack(MAGIC, flag << 29 | tail) + payload[start:] + bytes(_pad(tail)))
    return b"".join(parts)


def decode(data: bytes | memoryview, where: str = "record", offset: int = 0) -> tuple[bytes, int]:
    """(payload, bytes used) of the record at the start of `data`.

    `where` and `offset` only make error messages name the file and position.
    """
    pieces: list[bytes] = []
    position = 0
    while True:
        if len(data) - position < HEADER.size:
            raise RecordIOError(
                f"{where}: truncated record at offset {offset + position}: expected an 8-byte "
                f"header, {len(data) - position} bytes remain"
            )
        magic, lrec = HEADER.unpack_from(data, position)
        flag, length = lrec >> 29, lrec & MAX_LENGTH
        _check_part(where, offset + position, magic, flag, inside=bool(pieces))
        start = position + HEADER.size
        if len(data) - start < length:
            raise RecordIOError(
                f"{where}: truncated record at offset {offset + position}: header says "
                f"{length} bytes, {len(data) - start} remain"
            )
        pieces.append(bytes(data[start : start + length]))
        position = start + length + _pad(length)
        if flag in (WHOLE, LAST):
            return MAGIC_BYTES.join(pieces), min(position, len(data))


def record_starts(
    data: bytes | memoryview, start: int = 0, where: str = "data"
) -> Iterator[int]:
    """Offsets in `data` where a record begins, from the first record start at or after `start`.

    Resynchronises like dmlc's `SeekRecordBegin`: a record begins at an aligned magic followed
    by a length word whose flag is 0 or 1 (the writer never leaves an aligned magic in a
    payload, so nothing else matches). Stops where a header no longer fits in `data`; a record
    cut short there is for `decode` to report. `where` only makes error messages name the file.
    """
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    view = memoryview(data)
    position = start + _pad(start)
    while position + HEADER.size <= len(view):
        magic, lrec = HEADER.unpack_from(view, position)
        if magic == MAGIC and lrec >> 29 in (WHOLE, FIRST):
            break
        position += 4
    inside = False  # after a first or middle part: a continuation must follow
    while position + HEADER.size <= len(view):
        magic, lrec = HEADER.unpack_from(view, position)
        flag, length = lrec >> 29, lrec & MAX_LENGTH
        _check_part(where, position, magic, flag, inside)
        if flag in (WHOLE, FIRST):
            yield position
        inside = flag in (FIRST, MIDDLE)
        position += HEADER.size + length + _pad(length)


def _check_part(where: str, offset: int, magic: int, flag: int, inside: bool) -> None:
    """Raise unless a part header with this magic and flag may come here."""
    if magic != MAGIC:
        raise RecordIOError(
            f"{where}: bad magic at offset {offset}: expected 0x{MAGIC:08x}, found 0x{magic:08x}"
        )
    if flag not in ((MIDDLE, LAST) if inside else (WHOLE, FIRST)):
        expected = "a continuation part" if inside else "the start of a record"
        raise RecordIOError(
            f"{where}: at offset {offset} expected {expected}, found part flag {flag}"
        )


def read_index(text: str | bytes, where: str) -> tuple[list[str], list[int]]:
    """Keys and byte offsets from an `.idx` file (`key\\toffset` lines, UTF-8).

    An offset must be a plain non-negative decimal; whether it lies inside the `.rec` file is
    for the caller, who knows its size.
    """
    if isinstance(text, bytes):
        raw = text
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            number = raw.count(b"\n", 0, e.start) + 1
            raise RecordIOError(
                f"{where}: not UTF-8 at byte offset {e.start} (line {number})"
            ) from None
    keys, offsets = [], []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        key, tab, field = line.partition("\t")
        offset = field.strip()
        if not (tab and offset.isascii() and offset.isdigit() and len(offset) <= 20):
            raise RecordIOError(
                f"{where}: line {number} is not 'key<TAB>offset' with a non-negative "
                f"offset: {line[:80]!r}"
            )
        keys.append(key)
        offsets.append(int(offset))
    return keys, offsets


class Writer(Closing):
    """Writes `.rec` (and `.idx`) files byte-identical to MXNet's `MXIndexedRecordIO.write_idx`."""

    def __init__(
        self, rec_path: str | os.PathLike[str], idx_path: str | os.PathLike[str] | None = None
    ) -> None:
        self._rec = open(rec_path, "wb")  # noqa: SIM115 (closed by close())
        self._idx = None if idx_path is None else open(idx_path, "w", newline="\n")  # noqa: SIM115
        self.count = 0

    def write(self, record: bytes, key: Any = None) -> int:
        """Append one record; returns its byte offset. `key` defaults to a running count."""
        offset = self._rec.tell()
        self._rec.write(encode(record))
        if self._idx is not None:
            self._idx.write(f"{self.count if key is None else key}\t{offset}\n")
        self.count += 1
        return offset

    def close(self) -> None:
        self._rec.close()
        if self._idx is not None:
            self._idx.close()

