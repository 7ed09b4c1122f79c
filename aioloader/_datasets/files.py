"""One object per sample: local paths or URLs of any store (file://, http(s)://, s3://, gs://,
az://), with optional labels."""

from __future__ import annotations

import copy
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..storage import _storage as storage
from ..storage._local import read_path
from .base import Dataset
from .keys import KeyTable

LARGE_FILE = 1 << 20
"""Local files this large (the median of the first `SIZED`) are read in the decode processes."""
SIZED = 16


class Files(Dataset):
    """`fetch(i)` gives the bytes of the i-th object, or `(bytes, label)` when labels are given.

    When every object is a local file, a chunk of samples is read in one trip to a file thread
    (`batched_fetch`), not a task each; large local files are read in the decode processes
    (`read_in_decode`)."""

    _in_decode = False
    """This copy's items are read in the decode processes: `fetch` gives where they are."""

    def __init__(self, urls_or_paths: Iterable[str], labels: Iterable[Any] | None = None) -> None:
        if isinstance(urls_or_paths, (str, bytes, os.PathLike)):
            raise TypeError(
                f"Files takes a list of URLs or paths, got one: Files([{str(urls_or_paths)!r}]). "
                "For a folder of images, aioloader.vision.image_loader(folder) reads it."
            )
        urls = [storage.check_url(str(u)) for u in urls_or_paths]
        self.batched_fetch = all(storage.local_path(u) is not None for u in urls)
        self._urls = KeyTable(urls)
        self._labels: npt.NDArray[Any] | None = None
        if labels is not None:
            self._labels = np.asarray(list(labels) if not hasattr(labels, "__len__") else labels)
            if len(self._labels) != len(self._urls):
                raise ValueError(
                    f"got {len(self._labels)} labels for {len(self._urls)} files; give one each"
                )

    @classmethod
    def from_prefix(cls, prefix: str, labels: Iterable[Any] | None = None) -> Files:
        """Every object under `prefix`, in order: `s3://bucket/prefix/`, `gs://`, `az://`, or
        the whole bucket (`s3://bucket/`); a local folder (`data/train/`) at any depth. A
        listing that fails raises FetchError naming the prefix and the store's answer;
        http(s):// has no listing (ValueError)."""
        return cls(storage.list_prefix(prefix), labels)

    def __len__(self) -> int:
        return len(self._urls)

    def key(self, index: int) -> str:
        return self._urls[index]

    def fingerprint(self) -> dict[str, Any]:
        """The length and a digest of the URLs in order: another list of as many files, or
        the same in another order (a listing that sorts otherwise), would resume other
        samples. The same files moved elsewhere differ too: a state's "dataset" entry,
        removed, resumes them."""
        return {"length": len(self), "urls": self._urls.digest}

    def read_in_decode(self) -> Files | None:
        """These files read in the decode processes, where they are decoded, as DataLoader's
        workers read theirs: when every file is local and large (LARGE_FILE, by the median of
        the first SIZED). Their bytes then never cross the event loop and the channel to a
        decode process, which cost 7x DataLoader's CPU per 22 MB sample. Small files stay
        read here, a chunk in one trip to a file thread, many chunks at once. None: read
        here."""
        if not self.batched_fetch:
            return None
        sizes = []
        for index in range(min(SIZED, len(self))):
            try:
                sizes.append(os.stat(self._path(index)).st_size)
            except OSError:
                continue  # its read will say why
        if not sizes or statistics.median(sizes) < LARGE_FILE:
            return None
        in_decode = copy.copy(self)
        in_decode._in_decode = True
        return in_decode

    def load_in_workers(self) -> tuple[Callable[[Any], Any], int] | None:
        return (_read_in_decode, 1) if self._in_decode else None

    def _path(self, index: int) -> str:
        path = storage.local_path(self._urls[index])
        assert path is not None
        return path

    def _where(self, index: int) -> str | tuple[str, Any]:
        """What a decode process reads the sample from: its path, with its label."""
        if self._labels is None:
            return self._path(index)
        return self._path(index), self._labels[index].item()

    async def fetch(self, index: int) -> Any:
        if self._in_decode:
            return self._where(index)
        data = await storage.read(self._urls[index])
        if self._labels is None:
            return data
        return data, self._labels[index].item()

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        if self._in_decode:
            return [self._where(i) for i in indices]
        async with storage.borrowed() as reads:
            data = await reads.read_many([self._urls[i] for i in indices])
        if self._labels is None:
            return data
        return [(d, self._labels[i].item()) for d, i in zip(data, indices, strict=True)]


def _read_in_decode(where: str | tuple[str, Any]) -> Any:
    """A sample read in a decode process: the file's bytes, with its label."""
    if isinstance(where, tuple):
        return read_path(where[0]), where[1]
    return read_path(where)
