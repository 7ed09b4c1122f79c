"""Parquet files as a stream of rows: row groups fetched by ranged reads, a few ahead, decoded
a column at a time."""

from __future__ import annotations

import asyncio
import bisect
import heapq
import itertools
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import LoaderError
from .._loopthread import run_sync
from .._sampling import ShardInfo, epoch_order, get_shard_info
from ..storage import _storage as storage
from .base import Stream
from .tarshards import expand_braces

TAIL_BYTES = 64 << 10
"""Read from a file's end at construction: the footer of most files fits, else one more read."""
_MAGIC = b"PAR1"
_GROUP_ORDER, _WINDOW_ORDER = 6, 7
"""Spawn keys of the row-group order and of the shuffles within windows."""
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


@dataclass(frozen=True)
class _Share:
    """One rank's part of an epoch: its row groups in reading order, read in windows."""

    groups: list[int]
    window: int
    rows: int
    """Rows yielded: the same on every rank; the rows of `groups` past it are left out."""

    def windows(self) -> list[list[int]]:
        return [self.groups[i : i + self.window] for i in range(0, len(self.groups), self.window)]


class Parquet(Stream):
    """The rows of Parquet files (local paths, file://, http(s)://, s3://, brace patterns); each
    sample is a dict of column name to value.

    Values: binary -> bytes, string -> str, numbers and bools -> numpy scalars (keeping the
    column's dtype), lists -> numpy arrays (lists of structs or of lists -> Python lists),
    structs -> dicts, nulls -> None; other types as pyarrow's `as_py` gives them.

    Each file's footer is read once, at construction. The row groups of all files are the
    units of reading: only the requested columns' chunks are fetched, `row_groups_ahead` row
    groups in flight, each decoded by pyarrow off the event loop.

    Per epoch, the row groups are put in file order, or shuffled with the Loader's seed and
    the epoch; each goes to the rank with the fewest rows so far, so no row reaches two ranks.
    Every rank yields as many rows as the rank with the fewest, so that ranks take equal steps:
    the surplus at the end of the other ranks' shares (less than one row group each) is left
    out of that epoch. When shuffling, other rows are left out in other epochs, as the order
    changes; without shuffling the same ones always are. The rank's row count can differ
    between shuffled epochs: `len()` gives the current one.

    With the Loader's `shuffle=True`, rows are also shuffled within windows of `shuffle_window`
    consecutive row groups of the rank's share: memory holds a window (plus the row groups
    read ahead), and a larger window mixes rows from more places.
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
        self.shuffle_window = shuffle_window
        self.row_groups_ahead = row_groups_ahead
        self._files = run_sync(_load_all(self.urls, self.columns))
        groups = [
            (f, g, file.metadata.row_group(g).num_rows)
            for f, file in enumerate(self._files)
            for g in range(file.metadata.num_row_groups)
        ]
        self._groups = [(f, g) for f, g, rows in groups if rows]
        self._group_rows = np.array([rows for _, _, rows in groups if rows], dtype=np.int64)

    def __len__(self) -> int:
        """This rank's rows in the current epoch, from the footers alone."""
        return self._share(get_shard_info()).rows

    def __aiter__(self) -> AsyncGenerator[dict[str, Any], None]:
        return self.iter_from(0)

    async def iter_from(self, position: int) -> AsyncGenerator[dict[str, Any], None]:
        """Skips whole windows by their row counts without reading them."""
        info = get_shard_info()
        share = self._share(info)
        windows = share.windows()
        first, skip = self._window_at(windows, position)
        remaining = share.rows - position
        groups = [g for window in windows[first:] for g in window]
        async with aclosing(self._read_ahead(groups)) as decoded:
            for index in range(first, len(windows)):
                if remaining <= 0:
                    return
                parts = [await anext(decoded) for _ in windows[index]]
                part_of, row_of = self._window_rows(info, windows[index], index)
                part_of = part_of[skip : skip + remaining]
                row_of = row_of[skip : skip + remaining]
                skip, remaining = 0, remaining - len(part_of)
                for part, row in zip(part_of.tolist(), row_of.tolist(), strict=True):
                    yield parts[part].row(row)

    def key(self, item: Any, position: int) -> str:
        """`url#rowgroup/row`, worked out again from the position (errors only need it)."""
        info = get_shard_info()
        share = self._share(info)
        if not 0 <= position < share.rows:
            return f"row {position} of this rank's share"
        windows = share.windows()
        index, at = self._window_at(windows, position)
        part_of, row_of = self._window_rows(info, windows[index], index)
        file, group = self._groups[windows[index][int(part_of[at])]]
        return f"{self._files[file].url}#{group}/{int(row_of[at])}"

    def _window_at(self, windows: list[list[int]], position: int) -> tuple[int, int]:
        """The window holding row `position` of the share, and the row's place in it."""
        index = 0
        while index < len(windows) and position >= (rows := self._rows_of(windows[index])):
            index, position = index + 1, position - rows
        return index, position

    def _window_rows(
        self, info: ShardInfo, window: list[int], index: int
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The window's rows in yielding order: for each, its row group's place in the window
        and its row in that group."""
        sizes = self._group_rows[window]
        order = np.arange(int(sizes.sum()))
        if info.shuffle:
            sequence = np.random.SeedSequence(
                [info.seed, info.epoch], spawn_key=(_WINDOW_ORDER, info.rank, index)
            )
            order = np.random.default_rng(sequence).permutation(order)
        part_of = np.repeat(np.arange(len(window)), sizes)[order]
        return part_of, order - (np.cumsum(sizes) - sizes)[part_of]

    def _rows_of(self, groups: list[int]) -> int:
        return int(self._group_rows[groups].sum())

    def _share(self, info: ShardInfo) -> _Share:
        """Deal the epoch's row groups, each to the rank with the fewest rows so far (the
        lowest rank on ties): shares differ by less than one row group."""
        order = epoch_order(len(self._groups), info.shuffle, info.seed, info.epoch, _GROUP_ORDER)
        dealt: list[list[int]] = [[] for _ in range(info.world_size)]
        totals = [(0, rank) for rank in range(info.world_size)]
        for group in order.tolist():
            rows, rank = heapq.heappop(totals)
            dealt[rank].append(group)
            heapq.heappush(totals, (rows + int(self._group_rows[group]), rank))
        quota = min(rows for rows, _ in totals)
        if quota == 0:
            raise ValueError(
                f"{len(self._groups)} row groups cannot give each of {info.world_size} ranks "
                "rows: write smaller row groups, or more files"
            )
        mine = dealt[info.rank]
        needed = int(np.searchsorted(np.cumsum(self._group_rows[mine]), quota)) + 1
        return _Share(mine[:needed], self.shuffle_window if info.shuffle else 1, quota)

    async def _read_ahead(self, groups: list[int]) -> AsyncGenerator[_Rows, None]:
        """Decoded row groups in order, up to `row_groups_ahead` of them read at once."""
        pending = iter(groups)
        reading: deque[asyncio.Task[_Rows]] = deque()
        async with storage.borrowed() as reads:

            def start_next() -> None:
                group = next(pending, None)
                if group is not None:
                    reading.append(asyncio.create_task(self._read_group(reads, group)))

            try:
                for _ in range(self.row_groups_ahead):
                    start_next()
                while reading:
                    rows = await reading[0]
                    reading.popleft()
                    start_next()
                    yield rows
            finally:
                for task in reading:
                    task.cancel()
                await asyncio.gather(*reading, return_exceptions=True)

    async def _read_group(self, reads: storage.Storage, group: int) -> _Rows:
        """One ranged read per column chunk (storage merges neighbours), decoded in a thread."""
        file_index, index = self._groups[group]
        file = self._files[file_index]
        ranges = file.ranges[index]
        pieces = await asyncio.gather(*(reads.read_range(file.url, s, e) for s, e in ranges))
        fetched = _FetchedRanges(file.url, file.size, [s for s, _ in ranges], pieces)
        try:
            return await asyncio.to_thread(_decode, fetched, file.metadata, index, self.columns)
        except Exception as e:
            raise ParquetError(
                f"{file.url}: row group {index} could not be decoded: {type(e).__name__}: {e}"
            ) from e


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
    ranges = []
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        chunks = []
        for j in wanted:
            start, end = _chunk_range(group.column(j))
            if not 4 <= start <= end <= footer_start:
                raise ParquetError(
                    f"{url}: row group {g}, column {leaves[j]} claims bytes {start}..{end}, "
                    f"outside the data (bytes 4..{footer_start}): truncated or corrupt"
                )
            chunks.append((start, end))
        ranges.append(chunks)
    return _File(url, size, metadata, ranges)


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
