"""Reads over HTTP(S) with aiohttp: one pooled keep-alive session, retries on faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import aiohttp

from .._errors import FetchError
from ._counters import StorageCounters
from ._retry import Attempts, RetryPolicy, parse_retry_after


class _RetryableStatus(Exception):
    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.status = response.status
        self.reason = response.reason or ""
        self.delay = parse_retry_after(response.headers.get("Retry-After"))


RETRYABLE = (_RetryableStatus, aiohttp.ClientError, asyncio.TimeoutError)


def _classify(error: BaseException) -> tuple[str, int | None, float | None]:
    """(what went wrong, HTTP status, seconds the server asked to wait) of a retryable fault."""
    if isinstance(error, _RetryableStatus):
        return error.reason, error.status, error.delay
    return describe(error), None, None


def is_retryable(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


def describe(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def check_status(url: str, response: aiohttp.ClientResponse) -> None:
    """Return for 200/206; raise _RetryableStatus for faults worth retrying, FetchError else."""
    if response.status in (200, 206):
        return
    if is_retryable(response.status):
        raise _RetryableStatus(response)
    raise FetchError(url, response.reason or "", response.status)


def range_header(start: int | None, end: int | None) -> dict[str, str]:
    if start is None:
        return {}
    return {"Range": f"bytes={start}-{'' if end is None else end - 1}"}


class HttpStore:
    """One aiohttp session per event loop run; created on the first HTTP read."""

    def __init__(
        self, max_connections: int, policy: RetryPolicy, counters: StorageCounters
    ) -> None:
        self._max_connections = max_connections
        self._policy = policy
        self._counters = counters
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self._policy.timeout),
                auto_decompress=False,
                headers={"Accept-Encoding": "identity"},
            )
        return self._session

    async def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        session = self._get_session()
        attempts = Attempts(url, self._policy, self._counters)
        while True:
            try:
                async with session.get(url, headers=range_header(start, end)) as response:
                    self._counters.requests += 1
                    check_status(url, response)
                    body = await response.read()
                    return _cut_to_range(url, body, response.status, start, end)
            except RETRYABLE as e:
                await attempts.failed(*_classify(e))

    async def size(self, url: str) -> int:
        session = self._get_session()
        attempts = Attempts(url, self._policy, self._counters)
        while True:
            try:
                async with session.head(url, allow_redirects=True) as response:
                    self._counters.requests += 1
                    check_status(url, response)
                    if response.content_length is None:
                        raise FetchError(url, "the server sent no Content-Length for HEAD")
                    return response.content_length
            except RETRYABLE as e:
                await attempts.failed(*_classify(e))

    async def stream(
        self, url: str, start: int, end: int | None, chunk_size: int
    ) -> AsyncGenerator[bytes, None]:
        """Chunks of bytes start..end; a broken connection resumes where it stopped, and the
        retry budget counts failures in a row, so a long stream survives many blips."""
        session = self._get_session()
        attempts = Attempts(url, self._policy, self._counters)
        # a stream may run for minutes: bound each wait for data, not the whole response
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._policy.timeout, sock_read=self._policy.timeout
        )
        position = start
        while end is None or position < end:
            try:
                ranged = end is not None or position > 0
                headers = range_header(position if ranged else None, end)
                async with session.get(url, headers=headers, timeout=timeout) as response:
                    self._counters.requests += 1
                    check_status(url, response)
                    skip = position if response.status == 200 else 0  # server ignored Range
                    async for chunk in response.content.iter_chunked(chunk_size):
                        if skip:
                            chunk, skip = chunk[skip:], max(0, skip - len(chunk))
                        if end is not None:
                            chunk = chunk[: end - position]
                        if chunk:
                            position += len(chunk)
                            attempts.reset()
                            yield chunk
                        if end is not None and position >= end:
                            return
                if end is None:
                    return
                raise aiohttp.ClientPayloadError(f"body ended at byte {position} of {end}")
            except RETRYABLE as e:
                await attempts.failed(*_classify(e))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _cut_to_range(url: str, body: bytes, status: int, start: int | None, end: int | None) -> bytes:
    """A server that ignores Range sends the whole object (200); cut it to what was asked."""
    if start is None:
        return body
    if status == 200:
        body = body[start:end]
    if end is not None and len(body) != end - start:
        raise FetchError(url, f"short read: wanted bytes {start}..{end}, got {len(body)}")
    return body
