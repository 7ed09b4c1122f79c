"""Reads of local files through aiofiles, on a thread pool the store owns and shuts down."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import aiofiles

from ..errors import FetchError


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
            raise FetchError(path, f"{type(e).__name__}: {e.strerror or e}") from e
        if end is not None and len(data) != end - start:
            raise FetchError(path, f"short read: wanted bytes {start}..{end}, got {len(data)}")
        return data

    def close(self) -> None:
        self._executor.shutdown(wait=True)
