"""Tar archives read as a stream of chunks, and WebDataset's rules for grouping files.

Handles what Python's `tarfile` and GNU tar write: ustar names with prefixes, GNU long names
(type L) and pax headers (type x, `path=`). Only regular files are yielded.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ._errors import LoaderError

BLOCK = 512
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
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


def _compressed(header: bytes) -> str:
    """What a header that is not tar's was found to be, if a compressed stream."""
    for magic, kind in _COMPRESSIONS.items():
        if header.startswith(magic):
            return (f"; this is a {kind} stream: a compressed shard is not read yet "
                    "(decompress it, or repack it with `aioloader pack`)")
    return ""


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
    pax_size: int | None = None
    """A pax header's `size`, which overrides the next member's header (over 8 GiB, the
    header's field cannot hold it and says 0)."""
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
        if pax_size is not None and info.type not in _METADATA:
            info.size, pax_size = pax_size, None
        if info.size < 0:
            raise TarFormatError(
                f"{where}: tar member {name!r} at offset {at} declares a negative size "
                f"({info.size})"
            )
        limit = MAX_METADATA_BYTES if info.type in _METADATA else max_member_bytes
        if info.size > limit:
            raise TarFormatError(
                f"{where}: tar member {name!r} at offset {at} declares {info.size} bytes, "
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
            records = _pax_records(data, where, at + BLOCK)
            if info.type == tarfile.XHDTYPE:
                long_name = records.get(b"path", "") or long_name
                pax_size = _pax_number(records, b"size", where, at)
        elif info.type in _REGULAR:
            yield name, data, first_block
            long_name = first_block = None
        else:
            long_name = first_block = None


def _pax_number(records: dict[bytes, str], keyword: bytes, where: str, at: int) -> int | None:
    """A pax record that holds a number, if there is one."""
    value = records.get(keyword)
    if value is None:
        return None
    if not value.isdigit():
        raise TarFormatError(f"{where}: pax header at offset {at} gives {keyword.decode()} "
                             f"{value!r}, not a number")
    return int(value)


def _pax_records(data: bytes, where: str, offset: int) -> dict[bytes, str]:
    """The records of a pax extended header ("<length> <keyword>=<value>\\n" each), by
    keyword; a later record of a keyword wins, as in tar.

    Every record's framing is checked, so no length can stall or misplace the walk. `offset`
    is where `data` starts in the shard. As in CPython's tarfile, a NUL byte ends the records.
    """
    records: dict[bytes, str] = {}
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
        records[keyword] = value.decode("utf-8", "surrogateescape")
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
