"""TFRecord, as TensorFlow writes and reads it: framing, masked CRC-32C, index files, and
`tf.train.Example` parsed and written without TensorFlow.

A record is `[u64 length][u32 masked crc of the length's 8 bytes][data][u32 masked crc of
data]`, little-endian; the mask is TensorFlow's (`crc >> 15 | crc << 17`, plus 0xa282ead8). An
index file (DALI's `tfrecord2idx` format, which `aioloader pack` writes too) holds a line per
record: its offset and its size, framing included.

`tf.train.Example` is a protocol buffer: a map from feature names to a list of bytes, of
float32 or of int64. `parse_example` reads its wire format directly (no protobuf package) and
gives numpy arrays (`float32`, `int64`) and lists of bytes; `example` writes one.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ._closing import Closing
from ._errors import LoaderError

__all__ = [
    "FRAMING",
    "HEADER",
    "TFRecordError",
    "Writer",
    "example",
    "masked_crc",
    "parse_example",
    "read_index",
    "record",
    "record_size",
    "unframe",
]

_LENGTH = struct.Struct("<QI")
_CRC = struct.Struct("<I")
FRAMING = _LENGTH.size + _CRC.size
"""Bytes a record adds to its data: 16."""
_MASK_DELTA = 0xA282EAD8


class TFRecordError(LoaderError):
    """A .tfrecord or index file is not what it should be; names the file, the offset and the
    cause."""


def _crc32c(data: bytes | memoryview) -> int:
    try:
        import crc32c
    except ImportError:
        raise ImportError("TFRecord checks each record's CRC-32C with the crc32c package: pip "
                          "install 'aioloader[tfrecord]'") from None
    value: int = crc32c.crc32c(data)
    return value


def masked_crc(data: bytes | memoryview) -> int:
    """TensorFlow's masked CRC-32C of `data`."""
    crc = _crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord record."""
    length = struct.pack("<Q", len(data))
    return (length + _CRC.pack(masked_crc(length)) + data + _CRC.pack(masked_crc(data)))


def unframe(framed: bytes | memoryview, where: str = "record", offset: int = 0
            ) -> tuple[bytes, int]:
    """The data of the record at the start of `framed`, and the record's whole size; its
    length and its data checked by their CRCs. TFRecordError names `where` and `offset` (the
    record's place in its file) otherwise."""
    view = memoryview(framed)
    size = record_size(view, where, offset)
    length = size - FRAMING
    if len(view) < size:
        raise TFRecordError(f"{where}: truncated record at offset {offset}: its length says "
                            f"{length} bytes, {max(len(view) - _LENGTH.size, 0)} follow")
    data = view[_LENGTH.size : _LENGTH.size + length]
    if masked_crc(data) != _CRC.unpack_from(view, _LENGTH.size + length)[0]:
        raise TFRecordError(f"{where}: bad record at offset {offset}: the CRC of its "
                            f"{length} bytes of data does not match")
    return bytes(data), size


HEADER = _LENGTH.size
"""A record's header: its length and the length's CRC, 12 bytes."""


def record_size(header: bytes | memoryview, where: str = "record", offset: int = 0) -> int:
    """The whole size of the record whose header (12 bytes at least) `header` starts with, its
    length checked by its CRC."""
    if len(header) < _LENGTH.size:
        raise TFRecordError(f"{where}: truncated record at offset {offset}: {len(header)} "
                            f"bytes, its header alone takes {_LENGTH.size}")
    length, length_crc = _LENGTH.unpack_from(header)
    if masked_crc(memoryview(header)[:8]) != length_crc:
        raise TFRecordError(f"{where}: bad record at offset {offset}: the CRC of its length "
                            "does not match (not a TFRecord file, or damaged)")
    return int(length) + FRAMING


def read_index(text: str | bytes, where: str) -> tuple[list[int], list[int]]:
    """The offsets and sizes of an index file ("offset size" per line)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    offsets, sizes = [], []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2 or not all(f.isdigit() for f in fields):
            raise TFRecordError(f"{where}: line {number} is not 'offset size': {line[:60]!r}")
        offsets.append(int(fields[0]))
        sizes.append(int(fields[1]))
    return offsets, sizes


class Writer(Closing):
    """Writes records to a .tfrecord file and, given `index_path`, its index."""

    def __init__(self, path: str | os.PathLike[str],
                 index_path: str | os.PathLike[str] | None = None) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._index = None if index_path is None else open(index_path, "w")  # noqa: SIM115
        self._offset = 0

    def write(self, data: bytes) -> int:
        """Append one record; returns its offset."""
        framed = record(data)
        offset = self._offset
        self._file.write(framed)
        if self._index is not None:
            self._index.write(f"{offset} {len(framed)}\n")
        self._offset += len(framed)
        return offset

    def close(self) -> None:
        self._file.close()
        if self._index is not None:
            self._index.close()


# -- tf.train.Example -----------------------------------------------------------------------------

_BYTES, _FLOATS, _INT64S = 1, 2, 3
"""Feature's fields: bytes_list, float_list, int64_list."""


def parse_example(data: bytes, where: str = "record") -> dict[str, Any]:
    """A serialized `tf.train.Example` as {name: value}: a float32 array for a float list, an
    int64 array for an int64 list, a list of bytes for a bytes list."""
    try:
        features: dict[str, Any] = {}
        for field, value in _fields(data):
            if field != 1:  # Example.features
                continue
            for entry_field, entry in _fields(value):
                if entry_field == 1:  # Features.feature: a map entry
                    name, feature = _map_entry(entry)
                    features[name] = _feature(feature)
        return features
    except (IndexError, ValueError, UnicodeDecodeError) as e:
        raise TFRecordError(f"{where}: not a tf.train.Example: {e}") from None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError(f"a varint longer than 10 bytes at byte {at}")


def _fields(data: bytes) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a message: an int for a varint or fixed field, bytes for a
    length-delimited one."""
    at = 0
    while at < len(data):
        tag, at = _varint(data, at)
        field, wire = tag >> 3, tag & 7
        value: int | bytes
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            length, at = _varint(data, at)
            if at + length > len(data):
                raise ValueError(f"field {field} runs past the message's end")
            value, at = data[at : at + length], at + length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, at = int.from_bytes(data[at : at + width], "little"), at + width
        else:
            raise ValueError(f"field {field} has wire type {wire}")
        yield field, value


def _map_entry(entry: bytes) -> tuple[str, bytes]:
    name, feature = "", b""
    for field, value in _fields(entry):
        if field == 1:
            name = value.decode()
        elif field == 2:
            feature = value
    return name, feature


def _feature(feature: bytes) -> Any:
    for kind, values in _fields(feature):
        if kind == _BYTES:
            return [value for field, value in _fields(values) if field == 1]
        if kind == _FLOATS:
            return _numbers(values, np.dtype("<f4"), wire=5)
        if kind == _INT64S:
            return _numbers(values, np.dtype(np.int64), wire=0)
    return []  # a feature with no list set


def _numbers(values: bytes, dtype: np.dtype[Any], wire: int) -> npt.NDArray[Any]:
    """A FloatList's or Int64List's values: packed (as TensorFlow writes them) or not."""
    found: list[Any] = []
    for field, value in _fields(values):
        if field != 1:
            continue
        if isinstance(value, bytes):  # packed
            if wire == 5:
                found.extend(np.frombuffer(value, dtype).tolist())
            else:
                at = 0
                while at < len(value):
                    number, at = _varint(value, at)
                    found.append(number)
        elif wire == 5:
            found.append(np.frombuffer(value.to_bytes(4, "little"), dtype)[0])
        else:
            found.append(value)
    if wire == 0:  # int64 as two's complement in 64 bits
        return np.array([n - (1 << 64) if n >= 1 << 63 else n for n in found], np.int64)
    return np.array(found, dtype.newbyteorder("="))


def example(features: Mapping[str, Any]) -> bytes:
    """A serialized `tf.train.Example`: bytes, str or a list of them make a bytes list; floats
    (or a float array) a float list; ints (or an integer array) an int64 list."""
    entries = b""
    for name, value in features.items():
        entry = _length_field(1, name.encode()) + _length_field(2, _serialized(value, name))
        entries += _length_field(1, entry)
    return _length_field(1, entries)


def _serialized(value: Any, name: str) -> bytes:
    if isinstance(value, (bytes, str)):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, (bytes, str)) for v in value):
        listed = b"".join(_length_field(1, v.encode() if isinstance(v, str) else v)
                          for v in value)
        return _length_field(_BYTES, listed)
    array = np.atleast_1d(np.asarray(value))
    if array.dtype.kind == "f":
        return _length_field(_FLOATS, _length_field(1, array.astype("<f4").tobytes()))
    if array.dtype.kind in "iub":
        packed = b"".join(_varint_bytes(int(n) & ((1 << 64) - 1)) for n in array.ravel())
        return _length_field(_INT64S, _length_field(1, packed))
    raise TypeError(f"feature {name!r}: {type(value).__name__} is not bytes, str, floats or "
                    "integers")


def _length_field(field: int, data: bytes) -> bytes:
    return _varint_bytes(field << 3 | 2) + _varint_bytes(len(data)) + data


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)
