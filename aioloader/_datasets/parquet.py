"""Parquet files as a stream of rows divided by samples: the footers count each row group's
rows, so every rank gets the same number of rows, partial row groups included; row groups are
fetched by ranged reads and decoded a column at a time."""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._blocking import off_loop
from .._errors import LoaderError
from .._loopthread import run_sync
from ..storage import _storage as storage
from .indexed import IndexedStream
from .streaming import expand_braces

TAIL_BYTES = 64 << 10
"""Read from a file's end at construction: the footer of most files fits, else one more read."""
_MAGIC = b"PAR1"
Values = Sequence[Any] | npt.NDArray[Any]
"""A column's values, one per row."""


class ParquetError(LoaderError):
    """A Parquet file is corrupt or truncated, or lacks a requested column; names the file."""


@dataclass
class _File:
    url: str
    size: int
    metadata: Any
    """pyarrow's FileMetaData, parsed once: decoding a row group needs no more footer reads."""
    ranges: list[list[tuple[int, int]]]
    """Per row group, the byte ranges of the requested columns' chunks."""
    decoded_bytes: list[int]
    """Per row group, the requested columns' uncompressed bytes: what reading it holds."""


class Parquet(IndexedStream):
    """The rows of Parquet files (local paths, file://, http(s)://, s3://, brace patterns); each
    sample is a dict of column name to value.

    Values: binary -> bytes, string -> str, numbers and bools -> numpy scalars (keeping the
    column's dtype), lists -> numpy arrays (lists of structs or of lists -> Python lists),
    structs -> dicts, nulls -> None; other types as pyarrow's `as_py` gives them.

    Each file's footer is read once, at construction, and the files' schemas (of the requested
    columns) must agree. Only the requested columns' chunks are fetched; each row group is
    decoded by pyarrow off the event loop.

    An epoch divides by rows, not row groups: every rank gets the same number of rows (so DDP
    ranks take the same steps) from a contiguous run of row groups, a partial one at each end;
    without drop_last every row is read at least once, the last rank's share padded with
    repeats as DistributedSampler pads. With the Loader's `shuffle=True` the row groups' order
    is shuffled per epoch, and rows within windows of about `shuffle_window` row groups.
    Memory holds about a window plus what is read ahead (`row_groups_ahead`, and at most half
    the Loader's `memory_limit`); a window larger than that is read all the same, with a
    warning.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        columns: Sequence[str] | None = None,
        shuffle_window: int = 4,
        row_groups_ahead: int = 4,
    ) -> None:
        patterns = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [storage.check_url(u) for p in patterns for u in expand_braces(p)]
        if not self.urls:
            raise ValueError("Parquet needs at least one file")
        if shuffle_window < 1 or row_groups_ahead < 1:
            raise ValueError("shuffle_window and row_groups_ahead must be >= 1")
        self.columns = None if columns is None else list(columns)
        self._files = run_sync(_load_all(self.urls, self.columns))
        _check_schemas(self._files, self.columns)
        groups = [
            (f, g, file.metadata.row_group(g).num_rows)
            for f, file in enumerate(self._files)
            for g in range(file.metadata.num_row_groups)
        ]
        self._groups = [(f, g) for f, g, rows in groups if rows]
        self.unit_sizes = np.array([rows for _, _, rows in groups if rows], dtype=np.int64)
        if not len(self.unit_sizes):
            raise ParquetError(f"the Parquet files hold no rows: {self.urls[:3]}")
        self.window = shuffle_window * max(1, int(self.unit_sizes.mean()))
        self.pieces_ahead = max(1, -(-row_groups_ahead // shuffle_window))
        self._kept = row_groups_ahead + 2 * shuffle_window
        """Decoded row groups an iteration keeps for the pieces that share them."""

    def key(self, item: Any, position: int) -> str:
        """`url#rowgroup/row`, worked out again from the position (errors only need it)."""
        unit, row = self.locate(position)
        file, group = self._groups[unit]
        return f"{self._files[file].url}#{group}/{row}"

    def read_weight(self, unit: int, count: int) -> int:
        file, group = self._groups[unit]
        return self._files[file].decoded_bytes[group]

    async def read_samples(
        self, reads: storage.Storage, unit: int, start: int, stop: int, memo: dict[Any, Any]
    ) -> Sequence[Any]:
        """Rows start..stop of a row group, decoded once for the pieces that share it."""
        task = memo.pop(unit, None) or asyncio.ensure_future(self._read_group(reads, unit))
        memo[unit] = task
        while len(memo) > self._kept:
            memo.pop(next(iter(memo)))
        rows: _Rows = await task
        return [rows.row(i) for i in range(start, stop)]

    async def _read_group(self, reads: storage.Storage, group: int) -> _Rows:
        """One ranged read per column chunk (storage merges neighbours), decoded in a thread."""
        file_index, index = self._groups[group]
        file = self._files[file_index]
        ranges = file.ranges[index]
        pieces = await asyncio.gather(*(reads.read_range(file.url, s, e) for s, e in ranges))
        fetched = _FetchedRanges(file.url, file.size, [s for s, _ in ranges], pieces)
        try:
            return await off_loop(_decode, fetched, file.metadata, index, self.columns)
        except Exception as e:
            raise ParquetError(
                f"{file.url}: row group {index} could not be decoded: {type(e).__name__}: {e}"
            ) from e


def _check_schemas(files: list[_File], columns: list[str] | None) -> None:
    """The requested columns must have one type in every file: int32 in one and int64 in
    another would mix silently, and a column missing from one file would fail at collate."""
    first = files[0]
    expected = _schema(first, columns)
    for file in files[1:]:
        found = _schema(file, columns)
        if found != expected:
            names = dict.fromkeys([*expected, *found])
            diffs = [f"{n}: {expected.get(n, 'missing')} in {first.url}, "
                     f"{found.get(n, 'missing')} in {file.url}"
                     for n in names if expected.get(n) != found.get(n)]
            raise ParquetError("the Parquet files' schemas differ: " + "; ".join(diffs))


def _schema(file: _File, columns: list[str] | None) -> dict[str, str]:
    schema = file.metadata.schema.to_arrow_schema()
    names = schema.names if columns is None else columns
    return {name: str(schema.field(name).type) for name in names if name in schema.names}


class _Rows:
    """A decoded row group: one sequence of values per column, a dict per row on demand."""

    def __init__(self, names: list[str], columns: list[Values]) -> None:
        self._names = names
        self._columns = columns

    def row(self, index: int) -> dict[str, Any]:
        columns = zip(self._names, self._columns, strict=True)
        return {name: column[index] for name, column in columns}


class _FetchedRanges:
    """A read-only file for pyarrow that holds only the fetched byte ranges of a file of
    `size` bytes: a read outside them fails, rather than pyarrow opening the URL itself."""

    closed = False

    def __init__(self, url: str, size: int, starts: list[int], pieces: list[bytes]) -> None:
        self._url = url
        self._size = size
        self._pieces = sorted(zip(starts, pieces, strict=True))
        self._starts = [start for start, _ in self._pieces]
        self._position = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._position = offset + (0, self._position, self._size)[whence]
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, size: int = -1) -> memoryview:
        start = self._position
        end = self._size if size < 0 else min(start + size, self._size)
        slot = bisect.bisect_right(self._starts, start) - 1
        if slot >= 0:
            first, piece = self._pieces[slot]
            if end <= first + len(piece):
                self._position = end
                return memoryview(piece)[start - first : end - first]
        raise OSError(f"bytes {start}..{end} of {self._url} were not among those fetched")


def _decode(
    fetched: _FetchedRanges, metadata: Any, index: int, columns: list[str] | None
) -> _Rows:
    import pyarrow.parquet as pq

    # pre_buffer off: one read per column chunk, each within one fetched range
    reader = pq.ParquetFile(fetched, metadata=metadata, pre_buffer=False)
    table = reader.read_row_group(index, columns=columns)
    return _Rows(table.column_names, [_column(column) for column in table.columns])


def _column(chunked: Any) -> Values:
    parts = [_values(chunk) for chunk in chunked.chunks]
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(part, np.ndarray) for part in parts):
        return np.concatenate(parts)
    return [value for part in parts for value in part]


def _values(array: Any) -> Values:
    """One value per row of an Arrow array, converted a column at a time: numpy arrays, and
    per-row numpy views of a list column's flattened values, not a Python object per cell."""
    from pyarrow import types

    kind = array.type
    if types.is_dictionary(kind):
        return _values(array.dictionary_decode())
    if types.is_integer(kind) or types.is_floating(kind) or types.is_boolean(kind):
        if not array.null_count:
            numbers: npt.NDArray[Any] = array.to_numpy(zero_copy_only=False)
            return numbers
        scalar = np.dtype(kind.to_pandas_dtype()).type
        return [None if value is None else scalar(value) for value in array.to_pylist()]
    if _is_text_or_bytes(kind):
        objects: npt.NDArray[Any] = array.to_numpy(zero_copy_only=False)  # None for nulls
        return objects
    rows: list[Any]
    if types.is_struct(kind):
        names = [kind.field(i).name for i in range(kind.num_fields)]
        fields = zip(*(_values(array.field(i)) for i in range(kind.num_fields)), strict=True)
        rows = [dict(zip(names, values, strict=True)) for values in fields]
    elif types.is_list(kind) or types.is_large_list(kind):
        offsets = array.offsets.to_numpy()
        first, last = int(offsets[0]), int(offsets[-1])
        values = _values(array.values.slice(first, last - first))
        rows = [values[start:end] for start, end in itertools.pairwise((offsets - first).tolist())]
    elif types.is_fixed_size_list(kind):
        width, count = kind.list_size, len(array)
        values = _values(array.values.slice(array.offset * width, count * width))
        rows = [values[i : i + width] for i in range(0, count * width, width)]
    else:
        rows = array.to_pylist()
    return _with_nulls(rows, array)


def _is_text_or_bytes(kind: Any) -> bool:
    from pyarrow import types

    tests = (types.is_string, types.is_large_string, types.is_binary, types.is_large_binary,
             types.is_fixed_size_binary)
    return any(test(kind) for test in tests)


def _with_nulls(rows: list[Any], array: Any) -> list[Any]:
    if array.null_count:
        for index in np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False)).tolist():
            rows[index] = None
    return rows


async def _load_all(urls: list[str], columns: list[str] | None) -> list[_File]:
    async with storage.borrowed() as reads:
        return list(await asyncio.gather(*(_load(reads, url, columns) for url in urls)))


async def _load(reads: storage.Storage, url: str, columns: list[str] | None) -> _File:
    """Read the footer with one tail read (two if it is longer than TAIL_BYTES) and find the
    requested columns' chunks in every row group."""
    size = await reads.size(url)
    if size < 12:
        raise ParquetError(f"{url}: {size} bytes, too short for a Parquet file (truncated?)")
    tail_start = max(0, size - TAIL_BYTES)
    tail = await reads.read_range(url, tail_start, size)
    if tail[-4:] != _MAGIC:
        raise ParquetError(
            f"{url}: no Parquet footer: the file ends in {tail[-4:]!r}, not {_MAGIC!r} "
            "(truncated, or not a Parquet file)"
        )
    length = int.from_bytes(tail[-8:-4], "little")
    footer_start = size - 8 - length
    if footer_start < 4:
        raise ParquetError(f"{url}: corrupt footer: its length {length} exceeds the file")
    if footer_start < tail_start:
        tail = await reads.read_range(url, footer_start, tail_start) + tail
    footer = tail[len(tail) - 8 - length :]
    metadata = _parse_footer(url, footer)
    leaves = [metadata.schema.column(j).path for j in range(metadata.num_columns)]
    wanted = _leaves_of(url, leaves, columns)
    ranges, decoded = [], []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        chunks = []
        decoded.append(sum(group.column(j).total_uncompressed_size for j in wanted))
        for j in wanted if group.num_rows else []:  # an empty row group is never read
            start, end = _chunk_range(group.column(j))
            if not 4 <= start <= end <= footer_start:
                raise ParquetError(
                    f"{url}: row group {g}, column {leaves[j]} claims bytes {start}..{end}, "
                    f"outside the data (bytes 4..{footer_start}): truncated or corrupt"
                )
            chunks.append((start, end))
        ranges.append(chunks)
    return _File(url, size, metadata, ranges, decoded)


def _parse_footer(url: str, footer: bytes) -> Any:
    """pyarrow parses the metadata from a file made of the footer alone: no other read."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"pyarrow is needed to read Parquet: pip install 'aioloader[parquet]' ({e})"
        ) from None

    try:
        return pq.read_metadata(pa.BufferReader(_MAGIC + footer))
    except Exception as e:
        raise ParquetError(f"{url}: corrupt footer: {type(e).__name__}: {e}") from e


def _leaves_of(url: str, leaves: list[str], columns: list[str] | None) -> list[int]:
    """The leaf columns (column chunks) under the requested columns, as pyarrow selects them."""
    if columns is None:
        return list(range(len(leaves)))
    wanted = []
    for name in columns:
        under = [j for j, path in enumerate(leaves) if path == name or path.startswith(name + ".")]
        if not under:
            present = sorted({path.split(".")[0] for path in leaves})
            raise ParquetError(f"{url}: no column {name!r}; the file has {present}")
        wanted += under
    return sorted(set(wanted))


def _chunk_range(chunk: Any) -> tuple[int, int]:
    """Where a column chunk lies: from its dictionary page (when it has one) or its first data
    page, for its compressed size; as pyarrow computes it."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
        start = chunk.dictionary_page_offset
    return int(start), int(start + chunk.total_compressed_size)
