"""Tar archives read as a stream of chunks, and WebDataset's rules for grouping files.

Handles what Python's `tarfile` and GNU tar write: ustar names with prefixes, GNU long names
(type L), pax headers (type x, `path=`, `size=`) and sparse files (GNU's type S, and pax's
sparse formats 0.0, 0.1 and 1.0), given whole, holes included, as `tarfile` gives them. Only
regular files are yielded.
"""

from __future__ import annotations

import bz2
import lzma
import re
import tarfile
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

from ._errors import LoaderError

BLOCK = 512
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE)
_PAX_LENGTH = re.compile(rb"([0-9]{1,20}) ")
"""A pax record's decimal length and the space after it; 20 digits is already absurd."""
MAX_MEMBER_BYTES = 2 << 30
"""The largest tar member read by default (2 GiB): a member is held in memory whole."""
MAX_METADATA_BYTES = 1 << 20
"""The largest pax header or GNU long name: they hold a name and a few attributes, and a
pax header is parsed record by record on the event loop."""
_METADATA = (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE, tarfile.XGLTYPE)
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""WebDataset's base_plus_ext: the key runs to the first dot of the file name."""
_METADATA_NAME = re.compile(r"__[^/]*__($|/)")
"""WebDataset's skip_meta: `__name__` at the top, and whatever is in a `__name__/` folder."""


_COMPRESSIONS = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz",
                 b"\x28\xb5\x2f\xfd": "zstd"}
"""The magic numbers a compressed shard starts with."""


def compression_of(head: bytes) -> str | None:
    """The compression a shard's first bytes name, if any."""
    for magic, kind in _COMPRESSIONS.items():
        if head.startswith(magic):
            return kind
    return None


def _compressed(header: bytes) -> str:
    """What a header that is not tar's was found to be, if a compressed stream."""
    kind = compression_of(header)
    if kind is None:
        return ""
    return (f"; this is a {kind} stream where a tar header should be (a compressed shard "
            "is read only whole, from its first byte)")


INFLATED_CHUNK = 4 << 20
"""The most a compressed chunk gives at once: a small chunk of zeros can inflate a
thousandfold."""
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {
    "gzip": lambda: zlib.decompressobj(wbits=31),
    "bzip2": bz2.BZ2Decompressor,
    "xz": lzma.LZMADecompressor,
}
READABLE = tuple(_DECOMPRESSORS)
"""The compressions `inflated` reads."""


def _inflate(decompressor: Any, data: bytes) -> Iterator[bytes]:
    """What `data` decompresses to, INFLATED_CHUNK at most at a time, up to its stream's end."""
    while not decompressor.eof:
        out = decompressor.decompress(data, INFLATED_CHUNK)
        data = getattr(decompressor, "unconsumed_tail", b"")  # zlib's; bz2 and lzma keep it
        if not out and not data:
            return
        if out:
            yield out


async def inflated(chunks: AsyncIterator[bytes], where: str, kind: str,
                   error: type[Exception] | None = None) -> AsyncGenerator[bytes, None]:
    """A compressed file's chunks, decompressed (gzip, bzip2, xz: what Python's `tarfile`
    and so WebDataset read; streams one after another too, as gzip writes them), at most
    INFLATED_CHUNK at a time. What cannot be is `error` (the format's; TarFormatError)."""
    error = error or TarFormatError
    if kind not in _DECOMPRESSORS:
        raise error(f"{where}: a {kind} stream: only gzip, bzip2 and xz are read (as Python's "
                    "tarfile reads them); decompress it")
    decompressor = _DECOMPRESSORS[kind]()
    try:
        async for chunk in chunks:
            while chunk:
                if decompressor.eof:
                    if not chunk.strip(b"\0"):  # zero padding after the last stream
                        break
                    decompressor = _DECOMPRESSORS[kind]()
                for out in _inflate(decompressor, chunk):
                    yield out
                chunk = decompressor.unused_data if decompressor.eof else b""
    except (zlib.error, OSError, lzma.LZMAError, EOFError) as e:
        raise error(f"{where}: the {kind} stream is damaged: {e}") from None
    if not decompressor.eof:
        raise error(f"{where}: the {kind} stream ends before its end")


class TarFormatError(LoaderError):
    """A tar shard is damaged or breaks WebDataset's rules; names the shard and the place."""


class _Reader:
    """Exact-size reads over an async iterator of chunks."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buffer = bytearray()
        self.offset = 0

    async def read(self, size: int) -> bytes:
        while len(self._buffer) < size:
            try:
                self._buffer += await anext(self._chunks)
            except StopAsyncIteration:
                break
        with memoryview(self._buffer) as view:
            data = bytes(view[:size])  # one copy: a member may be gigabytes
        del self._buffer[:size]
        self.offset += len(data)
        return data

    async def skip(self, size: int) -> int:
        """Pass over `size` bytes without keeping them; how many there were."""
        skipped = min(size, len(self._buffer))
        del self._buffer[:skipped]
        while skipped < size:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                break
            used = min(len(chunk), size - skipped)
            self._buffer += memoryview(chunk)[used:]
            skipped += used
        self.offset += skipped
        return skipped


async def tar_members(
    chunks: AsyncIterator[bytes],
    where: str,
    max_member_bytes: int = MAX_MEMBER_BYTES,
    keep_data: bool = True,
    base: int = 0,
) -> AsyncGenerator[tuple[str, bytes, int], None]:
    """(name, data, start) of each regular file in a tar archive streamed as `chunks`: start
    is the offset of the member's first header block (a long name's or pax header's included)
    in the archive, whose first chunk is at offset `base`. Without `keep_data`, data is
    passed over and given as b"" (to index an archive).

    A member is held in memory whole, so one whose header declares more than
    `max_member_bytes` (`MAX_METADATA_BYTES` for pax headers and long names) is refused before
    any of it is read: a forged size cannot exhaust memory.
    """
    reader = _Reader(chunks)
    reader.offset = base
    long_name: str | None = None
    pax: list[tuple[bytes, str]] = []
    """The records of the pax header before the next member: its `size` overrides the
    header's (over 8 GiB, the header's field cannot hold it and says 0), and `GNU.sparse.*`
    make it a sparse file."""
    first_block: int | None = None
    while True:
        at = reader.offset
        if first_block is None:
            first_block = at
        header = await reader.read(BLOCK)
        if len(header) < BLOCK:
            if header:
                raise TarFormatError(
                    f"{where}: truncated tar header at offset {at}{_compressed(header)}")
            return  # no end-of-archive blocks: accept, as tar does
        if header == bytes(BLOCK):
            return
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except (tarfile.TarError, ValueError) as e:
            raise TarFormatError(
                f"{where}: bad tar header at offset {at}: {e}{_compressed(header)}") from None
        name = long_name or info.name
        sparse: _Sparse | None = None
        if info.type not in _METADATA:
            records = dict(pax)
            name = records.get(b"GNU.sparse.name") or name
            size = _pax_number(records, b"size", where, at)
            info.size = info.size if size is None else size
            if info.type == tarfile.GNUTYPE_SPARSE:
                sparse = await _old_gnu_sparse(header, reader, where, at)
            else:
                sparse = _pax_sparse(pax, where, at)
            pax = []
        if info.size < 0:
            raise TarFormatError(
                f"{where}: tar member {name!r} at offset {at} declares a negative size "
                f"({info.size})"
            )
        limit = MAX_METADATA_BYTES if info.type in _METADATA else max_member_bytes
        declared = max(info.size, sparse.size if sparse is not None else 0)
        if declared > limit:
            raise TarFormatError(
                f"{where}: tar member {name!r} at offset {at} declares {declared} bytes, "
                f"over the limit of {limit} bytes"
            )
        kept = keep_data or info.type in _METADATA
        data = await reader.read(info.size) if kept else b""
        present = len(data) if kept else await reader.skip(info.size)
        if present < info.size:
            raise TarFormatError(
                f"{where}: truncated tar member {name!r} at offset {at}: "
                f"{info.size} bytes declared, {present} present"
            )
        await reader.skip(-info.size % BLOCK)
        if info.type == tarfile.GNUTYPE_LONGNAME:
            long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
            records_here = _pax_records(data, where, at + BLOCK)
            if info.type == tarfile.XHDTYPE:
                long_name = dict(records_here).get(b"path", "") or long_name
                pax = records_here
        elif info.type in _REGULAR:
            if sparse is not None and kept:
                data = sparse.expand(data, f"{where}: sparse tar member {name!r} at offset {at}")
            yield name, data, first_block
            long_name = first_block = None
        else:
            long_name = first_block = None


class _Sparse:
    """Where a sparse file's stored pieces lie in the file, and its whole size: its data is
    the pieces, one after another (format 1.0: after a map of them, in decimal lines)."""

    def __init__(self, size: int, regions: list[tuple[int, int]] | None) -> None:
        self.size = size
        self.regions = regions
        """(offset, length) of each piece; None: the map leads the data (format 1.0)."""

    def expand(self, data: bytes, what: str) -> bytes:
        """The file, holes included, from its stored data."""
        regions, stored = self.regions, 0
        if regions is None:
            regions, stored = _leading_map(data, what)
        whole = bytearray(self.size)
        for offset, length in regions:
            if offset + length > self.size or stored + length > len(data):
                raise TarFormatError(
                    f"{what}: its map places {length} bytes at {offset}, past the file's "
                    f"{self.size} bytes or the {len(data) - stored} bytes stored")
            whole[offset : offset + length] = data[stored : stored + length]
            stored += length
        return bytes(whole)


def _leading_map(data: bytes, what: str) -> tuple[list[tuple[int, int]], int]:
    """Format 1.0's map at the start of a sparse file's data ("count\n" then "offset\n" and
    "length\n" for each piece, padded to a block), and where the pieces start."""
    numbers: list[int] = []
    position = 0
    while not numbers or len(numbers) < 1 + 2 * numbers[0]:
        end = data.find(b"\n", position, position + 21)
        if end < 0 or not data[position:end].isdigit():
            raise TarFormatError(f"{what}: its sparse map is not lines of numbers at byte "
                                 f"{position}: {data[position : position + 21]!r}")
        numbers.append(int(data[position:end]))
        position = end + 1
    pairs = numbers[1:]
    return list(zip(pairs[::2], pairs[1::2], strict=True)), -(-position // BLOCK) * BLOCK


async def _old_gnu_sparse(header: bytes, reader: _Reader, where: str, at: int) -> _Sparse:
    """GNU's own sparse member (type S): four pieces in its header, more in the blocks after it
    (21 each) while a block says more follow; its whole size at byte 483 of the header."""
    try:
        regions, more = _gnu_regions(header[386:482], 4), header[482]
        while more:
            block = await reader.read(BLOCK)
            if len(block) < BLOCK:
                raise TarFormatError(f"{where}: truncated sparse header after offset {at}")
            regions += _gnu_regions(block[:504], 21)
            more = block[504]
        return _Sparse(_octal(header[483:495]), regions)
    except ValueError as e:  # a number field that is not one
        raise TarFormatError(f"{where}: bad sparse header at offset {at}: {e}") from None


def _gnu_regions(data: bytes, count: int) -> list[tuple[int, int]]:
    """The (offset, length) pairs of a GNU sparse header's slots, up to the first empty one."""
    regions = []
    for slot in range(count):
        field = data[slot * 24 : slot * 24 + 24]
        if not field.strip(b"\0"):
            break
        regions.append((_octal(field[:12]), _octal(field[12:])))
    return regions


def _octal(field: bytes) -> int:
    """A tar number field: octal digits, or base-256 with the top bit set (GNU's for large
    numbers)."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _pax_sparse(records: list[tuple[bytes, str]], where: str, at: int) -> _Sparse | None:
    """A sparse file's map from the pax header before it (GNU's formats 0.0, 0.1 and 1.0);
    None when it is not sparse."""
    found = dict(records)
    size = (_pax_number(found, b"GNU.sparse.realsize", where, at)
            if b"GNU.sparse.realsize" in found else _pax_number(found, b"GNU.sparse.size",
                                                                 where, at))
    if found.get(b"GNU.sparse.major") == "1":
        regions = None
    elif b"GNU.sparse.map" in found:
        numbers = found[b"GNU.sparse.map"].split(",")
        if len(numbers) % 2 or not all(n.isdigit() for n in numbers):
            raise TarFormatError(f"{where}: pax header at offset {at} gives a sparse map that "
                                 f"is not pairs of numbers: {found[b'GNU.sparse.map'][:40]!r}")
        regions = list(zip(map(int, numbers[::2]), map(int, numbers[1::2]), strict=True))
    elif b"GNU.sparse.offset" in found:
        offsets = [int(v) for k, v in records if k == b"GNU.sparse.offset" and v.isdigit()]
        lengths = [int(v) for k, v in records if k == b"GNU.sparse.numbytes" and v.isdigit()]
        if len(offsets) != len(lengths):
            raise TarFormatError(f"{where}: pax header at offset {at} gives {len(offsets)} "
                                 f"sparse offsets for {len(lengths)} lengths")
        regions = list(zip(offsets, lengths, strict=True))
    else:
        return None
    if size is None:
        raise TarFormatError(f"{where}: pax header at offset {at} describes a sparse file "
                             "without its size (GNU.sparse.realsize or GNU.sparse.size)")
    return _Sparse(size, regions)


def _pax_number(records: dict[bytes, str], keyword: bytes, where: str, at: int) -> int | None:
    """A pax record that holds a number, if there is one."""
    value = records.get(keyword)
    if value is None:
        return None
    if not value.isdigit():
        raise TarFormatError(f"{where}: pax header at offset {at} gives {keyword.decode()} "
                             f"{value!r}, not a number")
    return int(value)


def _pax_records(data: bytes, where: str, offset: int) -> list[tuple[bytes, str]]:
    """The records of a pax extended header ("<length> <keyword>=<value>\\n" each), as
    (keyword, value) in order: by `dict`, a later record of a keyword wins, as in tar; sparse
    format 0.0 repeats its keywords.

    Every record's framing is checked, so no length can stall or misplace the walk. `offset`
    is where `data` starts in the shard. As in CPython's tarfile, a NUL byte ends the records.
    """
    records: list[tuple[bytes, str]] = []
    position = 0
    while position < len(data) and data[position] != 0:
        match = _PAX_LENGTH.match(data, position)
        end = position + int(match.group(1)) if match else 0
        record = data[match.end() : end] if match and end <= len(data) else b""
        keyword, equals, value = record[:-1].partition(b"=")  # of "keyword=value\n"
        if not (record.endswith(b"\n") and keyword and equals):
            raise TarFormatError(
                f"{where}: bad pax header record at offset {offset + position}: "
                f"{data[position : position + 40]!r}"
            )
        records.append((keyword, value.decode("utf-8", "surrogateescape")))
        position = end
    return records


def split_name(name: str) -> tuple[str, str] | None:
    """(key, lower-cased extension) by WebDataset's rules; None for files to pass over
    (no extension, or metadata: a `__name__` file or folder at the top level)."""
    if _METADATA_NAME.match(name):
        return None
    match = _KEY_AND_EXTENSION.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


async def samples(
    members: AsyncIterator[tuple[str, bytes, int]], url: str
) -> AsyncGenerator[dict[str, Any], None]:
    """Consecutive files with one key form a sample: {"__key__", "__url__", ext: bytes, ...}."""
    current: dict[str, Any] | None = None
    async for name, data, _ in members:
        parts = split_name(name)
        if parts is None:
            continue
        key, extension = parts
        if current is not None and current["__key__"] != key:
            yield current
            current = None
        if current is None:
            current = {"__key__": key, "__url__": url}
        if extension in current:
            raise TarFormatError(f"{url}: sample {key!r} has more than one {extension!r} file")
        current[extension] = data
    if current is not None:
        yield current


async def sample_starts(members: AsyncIterator[tuple[str, bytes, int]]) -> list[int]:
    """Where each sample of an archive starts (its first member's first header block), grouped
    as `samples` groups: with the archive's size after them, the index that lets a reader take
    samples i..j of a shard with one ranged read of bytes starts[i]..starts[j]."""
    starts: list[int] = []
    key = None
    async for name, _, start in members:
        parts = split_name(name)
        if parts is not None and parts[0] != key:
            starts.append(start)
            key = parts[0]
    return starts
