"""Reads of local paths and file:// URLs on a thread pool the store owns and shuts down
(aiofiles streams)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

import aiofiles

from .._errors import FetchError
from ._interface import Resumed, Versioned
from ._version import Version

if TYPE_CHECKING:
    from ._interface import StoreSettings

T = TypeVar("T")
MAX_THREADS = 32


def local_path(url: str) -> str | None:
    """The file-system path a local URL names, or None for a remote URL. A file:// URL naming
    another host is a ValueError: its path would be read on this one."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc.lower() not in ("", "localhost"):
            raise ValueError(
                f"{url!r} names the host {parts.netloc!r}: file:// reads this machine's files "
                "(file:///path or file://localhost/path); use http(s):// for another host"
            )
        return unquote(parts.path)
    if len(parts.scheme) > 1:  # one letter is a Windows drive
        return None
    return url


def scheme_of_file(url: str) -> bool:
    return urlsplit(url).scheme == "file"


def _error(path: str, error: OSError) -> FetchError:
    return FetchError(path, f"{type(error).__name__}: {error.strerror or error}")


def _path(url: str) -> str:
    path = local_path(url)
    if path is None:
        raise ValueError(f"{url!r} is not a local path or file:// URL")
    return path


class LocalStore:
    def __init__(self, settings: StoreSettings) -> None:
        self._executor = ThreadPoolExecutor(min(MAX_THREADS, settings.concurrency),
                                            thread_name_prefix="aioloader-file")

    async def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        """One trip to a file thread per read (open, read, close there): aiofiles' awaitable
        file would make three, and at thousands of files a second that is the main
        process's largest cost."""
        path = _path(url)
        try:
            data = await self.run(_read_file, path, start, end)
        except OSError as e:
            raise _error(path, e) from e
        if start is not None and end is not None and len(data) != end - start:
            raise FetchError(path, f"short read: wanted bytes {start}..{end}, got {len(data)}")
        return data

    async def read_versioned(self, url: str, start: int | None = None, end: int | None = None,
                             unless: Version | None = None) -> Versioned:
        """As `read`: local files are read afresh each time, never through the disk cache, so
        no version is asked for or given."""
        return Versioned(await self.read(url, start, end), Version(None, None, None))

    async def read_many(self, paths: list[str]) -> list[bytes]:
        """Whole files (paths, not URLs), in one trip to a file thread: for many small local
        files, a trip each would cost more than the reads."""
        try:
            return await self.run(_read_files, paths)
        except _ReadFailed as e:
            raise _error(e.path, e.error) from e.error

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """Run blocking file work on this store's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def size(self, url: str) -> int:
        path = _path(url)
        try:
            return await self.run(os.path.getsize, path)
        except OSError as e:
            raise _error(path, e) from e

    async def stream(self, url: str, start: int, end: int | None, chunk_size: int,
                     resumed: Resumed) -> AsyncGenerator[bytes, None]:
        """No resume: a file's read fails for good (FetchError), never `Retryable`."""
        path = _path(url)
        try:
            async with aiofiles.open(path, "rb", executor=self._executor) as f:
                await f.seek(start)
                position = start
                while end is None or position < end:
                    wanted = chunk_size if end is None else min(chunk_size, end - position)
                    chunk = await f.read(wanted)
                    if not chunk:
                        break
                    position += len(chunk)
                    yield chunk
        except OSError as e:
            raise _error(path, e) from e
        if end is not None and position < end:
            raise FetchError(path, f"short read: file ends at byte {position}, wanted {end}")

    @classmethod
    def list(cls, prefix: str) -> list[str]:
        """Every file under the folder `prefix` names, at any depth, in order (as object
        stores list a key prefix: by whole path segments): paths for a path, file:// URLs
        for one. Linked folders are followed, each once."""
        folder = _path(prefix).rstrip("/") or "/"
        if not os.path.isdir(folder):
            raise FetchError(prefix, f"no folder {folder!r} to list")
        found: list[str] = []
        seen: set[str] = set()
        for root, folders, names in os.walk(folder, followlinks=True):
            real = os.path.realpath(root)
            if real in seen:  # a link back up: walked already
                folders.clear()
                continue
            seen.add(real)
            found.extend(os.path.join(root, name) for name in names)
        found.sort()
        return [f"file://{quote(p)}" for p in found] if scheme_of_file(prefix) else found

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True)


def read_path(path: str, start: int | None = None, end: int | None = None) -> bytes:
    """A local file, whole or from `start` to `end`, read in the calling thread (a decode
    process reads its samples' files so); FetchError naming it when it cannot be."""
    try:
        return _read_file(path, start, end)
    except OSError as e:
        raise _error(path, e) from e


def _read_file(path: str, start: int | None, end: int | None) -> bytes:
    with open(path, "rb") as file:
        if start is None:
            return file.read()
        file.seek(start)
        return file.read(-1 if end is None else end - start)


class _ReadFailed(Exception):
    def __init__(self, path: str, error: OSError) -> None:
        self.path, self.error = path, error


def _read_files(paths: list[str]) -> list[bytes]:
    out = []
    for path in paths:
        try:
            out.append(_read_file(path, None, None))
        except OSError as e:
            raise _ReadFailed(path, e) from e
    return out
