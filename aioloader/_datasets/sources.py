"""Which dataset reads a source: .rec files (with their .idx beside them when there are),
tar shards, an image folder (a sub-folder per class), or one object per URL."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from .base import Dataset, Stream
from .files import Files
from .recordio import RecordIO
from .tarshards import TarShards

Kind = Literal["rec", "tar", "files"]


def for_source(
    source: str | Sequence[str], labels: Sequence[int] | None = None
) -> tuple[Dataset | Stream, Kind]:
    """The dataset for `source` and what kind it is; `labels` go with a list of URLs."""
    urls = [source] if isinstance(source, str) else list(source)
    if all(url.endswith(".rec") for url in urls):
        indexes = [url[: -len(".rec")] + ".idx" for url in urls]
        local = all("://" not in index for index in indexes)
        have_index = not local or all(Path(index).exists() for index in indexes)
        return RecordIO(urls, indexes if have_index else None), "rec"
    if all(url.endswith(".tar") for url in urls):
        return TarShards(urls), "tar"
    if len(urls) == 1 and Path(urls[0]).is_dir():
        from .._tools.packing import list_items

        items = list_items(Path(urls[0]))
        return Files([str(i.path) for i in items], [int(i.labels[0]) for i in items]), "files"
    return Files(urls, labels), "files"
