"""Indexes made by reading a dataset's files once, kept in a folder (by default in the user's
cache) so that the next job does not read the files again."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path


def index_folder(given: str | os.PathLike[str] | None, kind: str) -> Path:
    """`given`, or aioloader's folder for `kind` in the user's cache."""
    if given is not None:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "aioloader" / kind


def kept_path(folder: Path, url: str, suffix: str = ".json") -> Path:
    """Where the index of `url` is kept in `folder`."""
    return folder / (hashlib.sha256(url.encode()).hexdigest()[:40] + suffix)


def keep(path: Path, document: str) -> None:
    """Write an index into its folder, whole or not at all; a read-only folder costs a scan
    next time."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(document)
        staged.replace(path)
