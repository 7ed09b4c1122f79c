"""One object per sample: local paths or URLs of any store (file://, http(s)://, s3://, gs://,
az://), with optional labels."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..storage import _storage as storage
from .base import Dataset
from .keys import KeyTable


class Files(Dataset):
    """`fetch(i)` gives the bytes of the i-th object, or `(bytes, label)` when labels are given.

    When every object is a local file, a chunk of samples is read in one trip to a file thread
    (`batched_fetch`), not a task each."""

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

    async def fetch(self, index: int) -> Any:
        data = await storage.read(self._urls[index])
        if self._labels is None:
            return data
        return data, self._labels[index].item()

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        async with storage.borrowed() as reads:
            data = await reads.read_many([self._urls[i] for i in indices])
        if self._labels is None:
            return data
        return [(d, self._labels[i].item()) for d, i in zip(data, indices, strict=True)]
