"""Reads of s3://bucket/key through obstore (the optional extra `aioloader[s3]`).

obstore's Rust client is built for many small concurrent requests. Credentials, region and
endpoint come from the usual AWS environment variables (AWS_ACCESS_KEY_ID, AWS_REGION,
AWS_ENDPOINT_URL, ...), so S3-compatible stores such as MinIO work; an http:// endpoint is
allowed. obstore's own retries are turned off so that aioloader's budget, backoff and retry
counts apply to S3 as to HTTP.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import urlsplit

from .._errors import FetchError
from ._counters import StorageCounters
from ._retry import Attempts, RetryPolicy


def split(url: str) -> tuple[str, str]:
    """(bucket, key) of an s3:// URL."""
    parts = urlsplit(url)
    return parts.netloc, parts.path.lstrip("/")


def import_obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(
            "s3:// URLs need obstore: pip install 'aioloader[s3]'"
        ) from None
    return obstore


def make_store(bucket: str, timeout: float | None = None) -> Any:
    """An obstore S3Store for `bucket`, configured from the environment."""
    import_obstore()
    from obstore.store import S3Store

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    client_options: Any = {}
    if endpoint and endpoint.startswith("http://"):
        client_options["allow_http"] = True
    if timeout is not None:
        client_options["timeout"] = f"{timeout}s"
    return S3Store(bucket, client_options=client_options, retry_config={"max_retries": 0})


class S3Store:
    """One obstore store per bucket, made on first use."""

    def __init__(self, policy: RetryPolicy, counters: StorageCounters) -> None:
        self._policy = policy
        self._counters = counters
        self._stores: dict[str, Any] = {}
        self._obstore = import_obstore()

    def _locate(self, url: str) -> tuple[Any, str]:
        bucket, key = split(url)
        if bucket not in self._stores:
            self._stores[bucket] = make_store(bucket, self._policy.timeout)
        return self._stores[bucket], key

    async def _attempt(self, url: str, attempts: Attempts, error: Exception) -> None:
        """Give up at once on what retrying cannot mend; else wait and count a retry."""
        exceptions = self._obstore.exceptions
        if isinstance(error, exceptions.NotFoundError):
            raise FetchError(url, "no such key", 404) from error
        if isinstance(error, (exceptions.PermissionDeniedError,
                              exceptions.UnauthenticatedError)):
            raise FetchError(url, f"access refused: {error}", 403) from error
        await attempts.failed(f"{type(error).__name__}: {str(error).splitlines()[0]}")

    async def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        store, key = self._locate(url)
        attempts = Attempts(url, self._policy, self._counters)
        while True:
            try:
                self._counters.requests += 1
                if start is None:
                    result = await self._obstore.get_async(store, key)
                    return bytes(await result.bytes_async())
                data = await self._obstore.get_range_async(store, key, start=start, end=end)
                return bytes(data)
            except Exception as e:
                await self._attempt(url, attempts, e)

    async def size(self, url: str) -> int:
        store, key = self._locate(url)
        attempts = Attempts(url, self._policy, self._counters)
        while True:
            try:
                self._counters.requests += 1
                return int((await self._obstore.head_async(store, key))["size"])
            except Exception as e:
                await self._attempt(url, attempts, e)

    async def stream(
        self, url: str, start: int, end: int | None, chunk_size: int
    ) -> AsyncGenerator[bytes, None]:
        """Chunks of bytes start..end; a broken stream resumes where it stopped."""
        store, key = self._locate(url)
        attempts = Attempts(url, self._policy, self._counters)
        position = start
        while end is None or position < end:
            try:
                self._counters.requests += 1
                window = {"range": {"offset": position} if end is None else (position, end)}
                result = await self._obstore.get_async(store, key, options=window)
                async for chunk in result.stream(min_chunk_size=chunk_size):
                    position += len(chunk)
                    attempts.reset()
                    yield bytes(chunk)
                return
            except Exception as e:
                await self._attempt(url, attempts, e)


def list_keys(prefix_url: str) -> list[str]:
    """s3:// URLs of every object under an s3://bucket/prefix, in key order."""
    obstore = import_obstore()
    bucket, prefix = split(prefix_url)
    store = make_store(bucket)
    keys = [item["path"] for batch in obstore.list(store, prefix or None) for item in batch]
    return [f"s3://{bucket}/{key}" for key in sorted(keys)]
