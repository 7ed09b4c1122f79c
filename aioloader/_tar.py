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
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""WebDataset's base_plus_ext: the key runs to the first dot of the file name."""


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
        data = bytes(self._buffer[:size])
        del self._buffer[:size]
        self.offset += len(data)
        return data


async def tar_members(
    chunks: AsyncIterator[bytes], where: str
) -> AsyncGenerator[tuple[str, bytes], None]:
    """(name, data) of each regular file in a tar archive streamed as `chunks`."""
    reader = _Reader(chunks)
    long_name: str | None = None
    while True:
        at = reader.offset
        header = await reader.read(BLOCK)
        if len(header) < BLOCK:
            if header:
                raise TarFormatError(f"{where}: truncated tar header at offset {at}")
            return  # no end-of-archive blocks: accept, as tar does
        if header == bytes(BLOCK):
            return
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise TarFormatError(f"{where}: bad tar header at offset {at}: {e}") from None
        data = await reader.read(info.size)
        if len(data) < info.size:
            raise TarFormatError(
                f"{where}: truncated tar member {info.name!r} at offset {at}: "
                f"{info.size} bytes declared, {len(data)} present"
            )
        await reader.read(-info.size % BLOCK)
        if info.type == tarfile.GNUTYPE_LONGNAME:
            long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
        elif info.type == tarfile.XHDTYPE:
            long_name = _pax_path(data) or long_name
        elif info.type in _REGULAR:
            yield (long_name or info.name), data
            long_name = None
        elif info.type != tarfile.XGLTYPE:
            long_name = None


def _pax_path(data: bytes) -> str | None:
    """The `path` record of a pax extended header ("<length> path=<value>\\n" records)."""
    position = 0
    while position < len(data):
        space = data.index(b" ", position)
        length = int(data[position:space])
        keyword, _, value = data[space + 1 : position + length - 1].partition(b"=")
        if keyword == b"path":
            return value.decode("utf-8", "surrogateescape")
        position += length
    return None


def split_name(name: str) -> tuple[str, str] | None:
    """(key, lower-cased extension) by WebDataset's rules; None for files to pass over
    (no extension, or a `__name__` metadata file at the top level)."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    match = _KEY_AND_EXTENSION.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


async def samples(
    members: AsyncIterator[tuple[str, bytes]], url: str
) -> AsyncGenerator[dict[str, Any], None]:
    """Consecutive files with one key form a sample: {"__key__", "__url__", ext: bytes, ...}."""
    current: dict[str, Any] | None = None
    async for name, data in members:
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
