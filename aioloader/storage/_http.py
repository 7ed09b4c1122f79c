"""Reads over HTTP(S) with aiohttp: one pooled keep-alive session, retries on faults, and no
trust in what a server sends: never more than max_object_bytes held, bytes checked against the
range asked, an encoded body decoded (whole reads) or refused (ranges and streams)."""

from __future__ import annotations

import asyncio
import logging
import re
import zlib
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from urllib.parse import urlsplit

import aiohttp

from .._errors import FetchError
from ._interface import Resumed, StoreSettings, Versioned
from ._limits import check_range, too_large
from ._retry import Retryable, is_retryable, parse_retry_after
from ._version import Version

log = logging.getLogger("aioloader.storage")

_READ_CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_TOTAL = re.compile(r"bytes \d+-\d+/(\d+)")
_WBITS = {"gzip": 31, "x-gzip": 31, "deflate": 15}
"""zlib's window bits for each Content-Encoding we decode (deflate means zlib-wrapped)."""


@contextmanager
def _mapped(url: str) -> Iterator[None]:
    """The one boundary where aiohttp's errors become final (a FetchError: those asking again
    cannot mend) or `Retryable`."""
    try:
        yield
    except aiohttp.TooManyRedirects as e:
        raise FetchError(url, f"{len(e.history)} redirects: a redirect loop?") from e
    except aiohttp.InvalidURL as e:
        raise FetchError(url, f"bad URL or redirect: {describe(e)}") from e
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise Retryable(describe(e)) from e


def describe(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def check_status(url: str, response: aiohttp.ClientResponse) -> None:
    """Return for 200/206; raise Retryable for faults worth retrying, FetchError else."""
    if response.status in (200, 206):
        return
    if is_retryable(response.status):
        raise Retryable(response.reason or "", response.status,
                        parse_retry_after(response.headers.get("Retry-After")))
    raise FetchError(url, response.reason or "", response.status)


def range_header(start: int | None, end: int | None) -> dict[str, str]:
    if start is None:
        return {}
    return {"Range": f"bytes={start}-{'' if end is None else end - 1}"}


def check_content_range(
    url: str, response: aiohttp.ClientResponse, start: int | None, end: int | None
) -> None:
    """A 206 must carry exactly the bytes asked: other bytes would be taken for them."""
    sent = response.headers.get("Content-Range", "")
    match = _CONTENT_RANGE.fullmatch(sent)
    if (
        start is not None
        and match is not None
        and int(match[1]) == start
        and (end is None or int(match[2]) == end - 1)
    ):
        return
    asked = "no range" if start is None else f"bytes {start}-{'' if end is None else end - 1}"
    raise FetchError(
        url, f"asked for {asked}, the server sent {sent or 'no Content-Range'}", response.status
    )


def object_version(response: aiohttp.ClientResponse) -> Version:
    """The object's ETag, Last-Modified and size as a 200 or 206 answer gives them."""
    headers = response.headers
    total = _TOTAL.fullmatch(headers.get("Content-Range", ""))
    if total is not None:
        size: int | None = int(total[1])
    else:  # a 200's length is the object's; a 206 without a total leaves it unknown
        size = response.content_length if response.status == 200 else None
    return Version(headers.get("ETag"), headers.get("Last-Modified"), size)


def conditional(unless: Version | None) -> dict[str, str]:
    """If-None-Match its ETag, else If-Modified-Since its Last-Modified: a server answers 304,
    without a body, while the object is still that version."""
    if unless is not None and unless.etag is not None:
        return {"If-None-Match": unless.etag}
    if unless is not None and unless.last_modified is not None:
        return {"If-Modified-Since": unless.last_modified}
    return {}


def if_range(began: Version) -> dict[str, str]:
    """If-Range for a resume: the server sends the whole new object (a 200, refused by
    `Version.check`) rather than a range of it when the object changed. A weak ETag may not be
    sent there; Last-Modified may."""
    etag = began.etag if began.etag is not None and not began.etag.startswith("W/") else None
    validator = etag or began.last_modified
    return {} if validator is None else {"If-Range": validator}


def decoder_bits(url: str, response: aiohttp.ClientResponse, whole: bool) -> int | None:
    """zlib's window bits to decode the body with, None for a plain body; FetchError for an
    encoding we cannot decode, or any encoding where byte positions count."""
    encoding = response.headers.get("Content-Encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding not in _WBITS:
        raise FetchError(url, f"the server sent Content-Encoding {encoding!r} (asked: identity)")
    if not whole:
        raise FetchError(
            url, f"the server sent a {encoding}-encoded body for a range or stream: byte "
            "positions in an encoded body are meaningless"
        )
    return _WBITS[encoding]


class HttpStore:
    """One aiohttp session per event loop run; created on the first HTTP read."""

    def __init__(self, settings: StoreSettings) -> None:
        self._max_connections = settings.connections
        self._policy = settings.policy
        self._counters = settings.counters
        self._max_bytes = settings.max_object_bytes
        self._session: aiohttp.ClientSession | None = None
        self._warned_ranges = False

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
        data, _ = await self._get(url, start, end, {})
        return data

    async def read_versioned(self, url: str, start: int | None = None, end: int | None = None,
                             unless: Version | None = None) -> Versioned | None:
        data, response = await self._get(url, start, end, conditional(unless))
        if response.status == 304:
            return None
        return Versioned(data, object_version(response))

    async def _get(self, url: str, start: int | None, end: int | None,
                   conditions: dict[str, str]) -> tuple[bytes, aiohttp.ClientResponse]:
        """The bytes and the answer that brought them; a 304 to `conditions` brings none."""
        check_range(url, start, end, self._max_bytes)
        session = self._get_session()
        headers = range_header(start, end) | conditions
        with _mapped(url):
            async with session.get(url, headers=headers) as response:
                if conditions and response.status == 304:
                    self._counters.requests += 1
                    return b"", response
                data = await self._plain_whole(response) if start is None else None
                if data is None:
                    chunks = self._body(url, response, start, end, self._max_bytes,
                                        _READ_CHUNK)
                    data = b"".join([chunk async for chunk in chunks])
        if start is not None and end is not None and len(data) != end - start:
            raise FetchError(url, f"short read: wanted bytes {start}..{end}, got {len(data)}")
        return data, response

    async def size(self, url: str) -> int:
        with _mapped(url):
            async with self._get_session().head(url, allow_redirects=True) as response:
                self._counters.requests += 1
                check_status(url, response)
                if response.content_length is None:
                    raise FetchError(url, "the server sent no Content-Length for HEAD")
                return response.content_length

    async def stream(self, url: str, start: int, end: int | None, chunk_size: int,
                     resumed: Resumed) -> AsyncGenerator[bytes, None]:
        """A resume asks If-Range the first answer's validator, and checks the answer's.
        Not bound by max_object_bytes: a stream holds one chunk at a time (a .rec scanned
        without its .idx may be 100 GB)."""
        # a stream may run for minutes: bound each wait for data, not the whole response
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._policy.timeout, sock_read=self._policy.timeout
        )
        began = resumed.began
        first = start if end is not None or start > 0 else None
        headers = range_header(first, end) | ({} if began is None else if_range(began))
        with _mapped(url):
            async with self._get_session().get(url, headers=headers, timeout=timeout
                                               ) as response:
                if began is not None and response.status in (200, 206):
                    began.check(url, object_version(response), start)
                body = self._body(url, response, first, end, None, chunk_size, whole=False)
                resumed.began = began or object_version(response)
                async with aclosing(body):
                    async for chunk in body:
                        yield chunk

    async def _plain_whole(self, response: aiohttp.ClientResponse) -> bytes | None:
        """Most reads: a whole object, not encoded, whose announced size is within the
        limit, read in one call rather than chunk by chunk. None for any other answer, which
        `_body` checks and reads."""
        size = response.content_length
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        if (response.status != 200 or size is None or size > self._max_bytes
                or encoding not in ("", "identity")):
            return None
        self._counters.requests += 1
        return await response.read()

    def _body(
        self,
        url: str,
        response: aiohttp.ClientResponse,
        start: int | None,
        end: int | None,
        limit: int | None,
        chunk_size: int,
        whole: bool = True,
    ) -> AsyncGenerator[bytes, None]:
        """The bytes start..end (None: the whole object) of the answer to a GET, as they arrive,
        once its status, range and encoding are checked: the one way every read takes."""
        self._counters.requests += 1
        check_status(url, response)
        bits = decoder_bits(url, response, whole and start is None)
        skip, keep = 0, None if start is None or end is None else end - start
        if response.status == 206:
            check_content_range(url, response, start, end)
        elif start is not None:  # a 200: the whole object from byte 0
            self._range_ignored(url)
            skip = start
        chunks = _cut(url, response, skip, keep, limit, chunk_size)
        if bits is None:
            return chunks
        assert limit is not None  # only whole reads are decoded
        return _decoded(url, chunks, bits, limit)

    def _range_ignored(self, url: str) -> None:
        """Count a 200 answer to a Range request; say so once per storage."""
        self._counters.ranges_ignored += 1
        if not self._warned_ranges:
            self._warned_ranges = True
            parts = urlsplit(url)
            log.warning(
                "%s://%s ignores Range requests: every ranged read downloads its object up to "
                "the range's end (counted in ranges_ignored; warned once)",
                parts.scheme, parts.netloc,
            )

    @classmethod
    def list(cls, prefix: str) -> list[str]:
        raise ValueError(f"{prefix!r}: HTTP has no listing of a prefix; give the URLs")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _cut(
    url: str,
    response: aiohttp.ClientResponse,
    skip: int,
    keep: int | None,
    limit: int | None,
    chunk_size: int,
) -> AsyncGenerator[bytes, None]:
    """The body after its first `skip` bytes, `keep` of them (None: to the end), never more
    than `limit` (None: a stream, held a chunk at a time): refused up front when
    Content-Length says so, else counted as it arrives. Stopping before the end drops the
    connection rather than reading on."""
    size = response.content_length
    if limit is not None and keep is None and size is not None and size - skip > limit:
        raise too_large(url, limit, f"the server announced {size} bytes")
    kept = 0
    async for data in response.content.iter_chunked(chunk_size):
        chunk = data[skip:] if skip else data
        skip = max(0, skip - len(data))
        if keep is not None:
            chunk = chunk[: keep - kept]
        kept += len(chunk)
        if limit is not None and kept > limit:
            raise too_large(url, limit, "the body ran on")
        if chunk:
            yield chunk
        if kept == keep:
            if not response.content.at_eof():
                response.close()
            return


async def _decoded(
    url: str, chunks: AsyncGenerator[bytes, None], bits: int, limit: int
) -> AsyncGenerator[bytes, None]:
    """Inflate as the body arrives, never past `limit` decoded bytes: a few megabytes of gzip
    can hold gigabytes."""
    inflater = zlib.decompressobj(bits)
    size = 0
    try:
        async with aclosing(chunks):
            async for data in chunks:
                while data:
                    if inflater.eof:
                        raise FetchError(url, "bytes after the end of the encoded body")
                    out = inflater.decompress(data, limit - size + 1)
                    size += len(out)
                    if size > limit:
                        raise too_large(url, limit, "the decoded body ran on")
                    if out:
                        yield out
                    data = inflater.unconsumed_tail or inflater.unused_data
    except zlib.error as e:
        raise FetchError(url, f"cannot decode the body: {e}") from e
    if not inflater.eof:
        raise FetchError(url, "the encoded body ended early")
