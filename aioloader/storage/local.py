"""Reads of local files through aiofiles, on a thread pool the store owns and shuts down."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor

import aiofiles

from ..errors import FetchError


def _error(path: str, error: OSError) -> FetchError:
    return FetchError(path, f"{type(error).__name__}: {error.strerror or error}")


class LocalStore:
    def __init__(self, max_threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_threads, thread_name_prefix="aioloader-file")

    async def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            async with aiofiles.open(path, "rb", executor=self._executor) as f:
                if start is None:
                    return await f.read()
                await f.seek(start)
                data = await f.read(end - start if end is not None else -1)
        except OSError as e:
            raise _error(path, e) from e
        if end is not None and len(data) != end - start:
            raise FetchError(path, f"short read: wanted bytes {start}..{end}, got {len(data)}")
        return data

    async def size(self, path: str) -> int:
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, os.path.getsize, path)
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
