"""One object per sample: local paths or URLs of any store (file://, http(s)://, s3://, gs://,
az://), with optional labels."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from contextlib import aclosing
from typing import Any

import numpy as np
import numpy.typing as npt

from .._ipc.shared_bytes import SharedBytes
from ..storage import _storage as storage
from ..storage._limits import too_large
from ..storage._local import read_path
from .base import Dataset
from .keys import KeyTable

LARGE_FILE = 1 << 20
"""Local files this large (the median of the first `SIZED`) are read in the decode processes;
remote objects this large are read into shared memory for them."""
SIZED = 16


class Files(Dataset):
    """`fetch(i)` gives the bytes of the i-th object, or `(bytes, label)` when labels are given.

    When every object is a local file, a chunk of samples is read in one trip to a file thread
    (`batched_fetch`), not a task each. For decode processes on this machine, large local files
    are read there, and large remote objects are read into shared memory they take them from
    (`for_local_decode`)."""

    _shares: list[int] | None = None
    """This copy hands large remote objects to the decode processes in shared memory: the
    sizes of its first reads, until SIZED tell whether they are large."""

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

    def for_local_decode(self) -> Files | None:
        """These objects as decode processes on this machine take them best, when they are
        large (LARGE_FILE, by the median of the first SIZED): local files read there, where
        they are decoded, as DataLoader's workers read theirs; remote objects read from the
        socket into shared memory they take the bytes from. Either way the bytes never cross
        the channel to a decode process (which cost 7x DataLoader's CPU per 22 MB sample).
        Small objects stay read here and sent: local ones a chunk in one trip to a file
        thread, remote ones with hedging. None: all are read here."""
        copy_ = object.__new__(type(self))  # not copy.copy: a subclass may reduce otherwise
        copy_.__dict__.update(vars(self))
        if not self.batched_fetch:
            copy_._shares = []  # sized as they arrive: a remote size costs a request
            return copy_
        sizes = []
        for index in range(min(SIZED, len(self))):
            try:
                sizes.append(os.stat(self._path(index)).st_size)
            except OSError:
                continue  # its read will say why
        if not sizes or statistics.median(sizes) < LARGE_FILE:
            return None
        copy_.reads_in_decode = True
        return copy_

    def load_in_workers(self) -> tuple[Callable[[Any], Any], int] | None:
        return (_in_decode, 1) if self.reads_in_decode or self._shares is not None else None

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
        if self.reads_in_decode:
            return self._where(index)
        url = self._urls[index]
        data = await (storage.read(url) if self._shares is None else self._read_shared(url))
        if self._labels is None:
            return data
        return data, self._labels[index].item()

    async def fetch_many(self, indices: Sequence[int]) -> list[Any]:
        if self.reads_in_decode:
            return [self._where(i) for i in indices]
        async with storage.borrowed() as reads:
            data = await reads.read_many([self._urls[i] for i in indices])
        if self._labels is None:
            return data
        return [(d, self._labels[i].item()) for d, i in zip(data, indices, strict=True)]

    async def _read_shared(self, url: str) -> bytes | SharedBytes:
        """A remote object, into shared memory as it arrives once objects are known to be
        large; until then, and through a disk cache, read as any other."""
        shares = self._shares
        assert shares is not None
        async with storage.borrowed() as reads:
            known = len(shares) >= min(SIZED, len(self))
            if not known or statistics.median(shares) < LARGE_FILE or reads.caches_on_disk:
                data = await reads.read(url)
                if not known:
                    shares.append(len(data))
                return data
            shared = SharedBytes.new()
            async with aclosing(reads.stream(url)) as body:
                async for chunk in body:
                    shared.write(chunk)
                    if shared.nbytes > reads.max_object_bytes:
                        raise too_large(url, reads.max_object_bytes, "the body ran on")
            return shared


def _in_decode(item: Any) -> Any:
    """A sample as decode gets it, in a decode process: a file read there, or the bytes taken
    from shared memory; with its label."""
    if isinstance(item, tuple):
        return _in_decode(item[0]), item[1]
    if isinstance(item, str):
        return read_path(item)
    if isinstance(item, SharedBytes):
        return item.take()
    return item
