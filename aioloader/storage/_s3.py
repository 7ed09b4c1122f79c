"""Reads of s3://bucket/key through obstore (the optional extra `aioloader[s3]`).

obstore's Rust client is built for many small concurrent requests. Credentials, region and
endpoint come from the usual AWS environment variables (AWS_ACCESS_KEY_ID, AWS_REGION,
AWS_ENDPOINT_URL, ...), so S3-compatible stores such as MinIO work; an http:// endpoint is
allowed. obstore's own retries are turned off so that aioloader's budget, backoff and retry
counts apply to S3 as to HTTP; what retrying cannot mend (a missing key, refused access, a range
past the end: the 4xx family) fails at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncGenerator
from typing import Any

from .._errors import FetchError
from ._counters import StorageCounters
from ._limits import DEFAULT_MAX_OBJECT_BYTES, check_range, too_large
from ._retry import Attempts, RetryPolicy, is_retryable
from ._version import Version, changed

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>(\w+)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def split(url: str, prefix: bool = False) -> tuple[str, str]:
    """(bucket, key) of an s3://bucket/key URL, taken literally as S3 takes keys (`?` and `#`
    belong to the key). A ValueError naming the URL for what S3 would read as another thing
    than meant: a bucket name against S3's rules, no key (a GET of the bucket is its listing),
    an empty path segment. A `prefix` may be empty (the whole bucket) and end in `/`."""
    bucket, _, key = url[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"{url!r}: bucket name {bucket!r} breaks S3's naming rules (3 to 63 lowercase "
            "letters, digits, dots and hyphens, starting and ending with a letter or digit)"
        )
    segments = key.split("/")
    if not prefix and not key:
        raise ValueError(f"{url!r} has no object key: give s3://{bucket}/KEY")
    if "" in (segments[:-1] if prefix else segments):
        raise ValueError(f"{url!r} has an empty path segment (// or a key ending in /)")
    return bucket, key


def _reason(error: Exception) -> tuple[str, int | None]:
    """(one line saying what went wrong, the HTTP status) of an obstore error, whose text runs
    on for dozens of lines of debug output; S3's error code and message when it sent them."""
    text = str(error)
    found = _STATUS.search(text)
    status = int(found[1]) if found else None
    if isinstance(error, FileNotFoundError):  # obstore 0.12's missing key
        status = 404
    code, message = _CODE.search(text), _MESSAGE.search(text)
    if code is None:
        return (text.splitlines() or [type(error).__name__])[0][:300], status
    return code[1] + (f": {message[1]}" if message else ""), status


def import_obstore() -> Any:
    try:
        import obstore
    except ImportError as e:
        raise ImportError(
            f"obstore is needed for s3:// URLs: pip install 'aioloader[s3]' ({e})"
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

    def __init__(
        self,
        policy: RetryPolicy,
        counters: StorageCounters,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
    ) -> None:
        self._policy = policy
        self._counters = counters
        self._max_bytes = max_object_bytes
        self._stores: dict[str, Any] = {}
        self._obstore = import_obstore()
        errors = self._obstore.exceptions
        self._final = (
            FileNotFoundError, errors.NotFoundError, errors.PermissionDeniedError,
            errors.UnauthenticatedError, errors.PreconditionError, errors.NotModifiedError,
            errors.InvalidPathError, errors.NotSupportedError,
            errors.UnknownConfigurationKeyError,
        )

    def _locate(self, url: str) -> tuple[Any, str]:
        bucket, key = split(url)
        if bucket not in self._stores:
            self._stores[bucket] = make_store(bucket, self._policy.timeout)
        return self._stores[bucket], key

    async def _attempt(self, url: str, attempts: Attempts, error: Exception) -> None:
        """Give up at once on what retrying cannot mend (obstore 0.12 raises a plain
        FileNotFoundError for a missing key, a GenericError for a 416); else wait and count a
        retry."""
        if isinstance(error, FetchError):
            raise error
        reason, status = _reason(error)
        if isinstance(error, self._final) or (status is not None and not is_retryable(status)):
            raise FetchError(url, reason, status) from error
        await attempts.failed(f"{type(error).__name__}: {reason}", status)

    async def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        check_range(url, start, end, self._max_bytes)
        store, key = self._locate(url)
        attempts = Attempts(url, self._policy, self._counters)
        while True:
            try:
                self._counters.requests += 1
                if start is None:
                    result = await self._obstore.get_async(store, key)
                    self._check_size(url, int(result.meta["size"]))
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
        """Chunks of bytes start..end; a broken stream resumes where it stopped, in the same
        object (If-Match its ETag, and its size checked). Not bound by max_object_bytes: a
        stream holds one chunk at a time."""
        store, key = self._locate(url)
        attempts = Attempts(url, self._policy, self._counters)
        position = start
        began: Version | None = None
        while end is None or position < end:
            try:
                self._counters.requests += 1
                options: dict[str, Any] = {
                    "range": {"offset": position} if end is None else (position, end)
                }
                if began is not None and began.etag is not None:
                    options["if_match"] = began.etag
                result = await self._obstore.get_async(store, key, options=options)
                now = _version(result.meta)
                if began is not None:
                    began.check(url, now, position)
                began = began or now
                async for chunk in result.stream(min_chunk_size=chunk_size):
                    position += len(chunk)
                    attempts.reset()
                    yield bytes(chunk)
                return
            except self._obstore.exceptions.PreconditionError as e:  # If-Match refused
                raise changed(url, position, f"it no longer matches {began}") from e
            except Exception as e:
                await self._attempt(url, attempts, e)

    def _check_size(self, url: str, size: int) -> None:
        """Refuse, before its body is read, an answer that would take a read (or a stream,
        counted from where it began) past max_object_bytes."""
        if size > self._max_bytes:
            raise too_large(url, self._max_bytes, f"the object has {size} bytes to read")


def _version(meta: Any) -> Version:
    """The object's ETag, Last-Modified and size as a get's metadata gives them (its size is
    the whole object's, also for a range)."""
    return Version(meta["e_tag"], meta["last_modified"].isoformat(), int(meta["size"]))


def list_keys(prefix_url: str) -> list[str]:
    """s3:// URLs of every object under an s3://bucket/prefix (which may be empty: the whole
    bucket), in key order."""
    obstore = import_obstore()
    bucket, prefix = split(prefix_url, prefix=True)
    store = make_store(bucket)
    try:
        keys = [item["path"] for batch in obstore.list(store, prefix or None) for item in batch]
    except Exception as e:
        reason, status = _reason(e)
        raise FetchError(prefix_url, f"{reason} (listing the prefix)", status) from e
    return [f"s3://{bucket}/{key}" for key in sorted(keys)]
