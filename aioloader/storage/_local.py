"""Reads of local files on a thread pool the store owns and shuts down (aiofiles streams)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiofiles

from .._errors import FetchError

T = TypeVar("T")


def _error(path: str, error: OSError) -> FetchError:
    return FetchError(path, f"{type(error).__name__}: {error.strerror or error}")


class LocalStore:
    def __init__(self, max_threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="aioloader-file")

    async def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        """One trip to a file thread per read (open, read, close there): aiofiles' awaitable
        file would make three, and at thousands of files a second that is the main
        process's largest cost."""
        try:
            data = await self.run(_read_file, path, start, end)
        except OSError as e:
            raise _error(path, e) from e
        if start is not None and end is not None and len(data) != end - start:
            raise FetchError(path, f"short read: wanted bytes {start}..{end}, got {len(data)}")
        return data

    async def read_many(self, paths: list[str]) -> list[bytes]:
        """Whole files, in one trip to a file thread: for many small local files, a trip
        each would cost more than the reads."""
        try:
            return await self.run(_read_files, paths)
        except _ReadFailed as e:
            raise _error(e.path, e.error) from e.error

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """Run blocking file work on this store's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    async def size(self, path: str) -> int:
        try:
            return await self.run(os.path.getsize, path)
        except OSError as e:
            raise _error(path, e) from e

    async def stream(
        self, path: str, start: int, end: int | None, chunk_size: int
    ) -> AsyncGenerator[bytes, None]:
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

    def close(self) -> None:
        self._executor.shutdown(wait=True)


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
