"""Reads over HTTP(S) with aiohttp: one pooled keep-alive session, retries on faults."""

from __future__ import annotations

import asyncio

import aiohttp

from ..errors import FetchError
from ..stats import LoaderStats
from .retry import RetryPolicy, parse_retry_after


def is_retryable(status: int) -> bool:
    return status in (408, 425, 429) or status >= 500


def describe(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class HttpStore:
    """One aiohttp session per event loop run; created on the first HTTP read."""

    def __init__(self, max_connections: int, policy: RetryPolicy, stats: LoaderStats) -> None:
        self._max_connections = max_connections
        self._policy = policy
        self._stats = stats
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
        headers = {} if start is None else {"Range": f"bytes={start}-{_last_byte(start, end)}"}
        session = self._get_session()
        policy = self._policy
        last_problem, last_status = "", None
        for attempt in range(policy.retries + 1):
            if attempt:
                self._stats.retries += 1
            try:
                async with session.get(url, headers=headers) as response:
                    self._stats.requests += 1
                    if response.status in (200, 206):
                        body = await response.read()
                        return _cut_to_range(url, body, response.status, start, end)
                    if not is_retryable(response.status):
                        raise FetchError(url, response.reason or "", response.status)
                    last_problem, last_status = response.reason or "", response.status
                    delay = parse_retry_after(response.headers.get("Retry-After"))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last_problem, last_status, delay = describe(e), None, None
            if attempt < policy.retries:
                await asyncio.sleep(policy.backoff(attempt) if delay is None else delay)
        raise FetchError(
            url, f"{last_problem}; gave up after {policy.retries + 1} attempts", last_status
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _last_byte(start: int, end: int | None) -> str:
    return "" if end is None else str(end - 1)


def _cut_to_range(url: str, body: bytes, status: int, start: int | None, end: int | None) -> bytes:
    """A server that ignores Range sends the whole object (200); cut it to what was asked."""
    if start is None:
        return body
    if status == 200:
        body = body[start:end]
    if end is not None and len(body) != end - start:
        raise FetchError(url, f"short read: wanted bytes {start}..{end}, got {len(body)}")
    return body
