"""Reads of object stores through obstore's Rust client, built for many small concurrent
requests: s3://bucket/key (the extra `aioloader[s3]`), gs://bucket/key (`aioloader[gcs]`),
az://container/key and abfs[s]://container@account.dfs.core.windows.net/key
(`aioloader[azure]`).

Credentials, region and endpoint come from each cloud's usual environment variables (AWS_*,
GOOGLE_*, AZURE_*), so S3-compatible stores such as MinIO and the emulators work; an http://
endpoint is allowed. obstore's own retries are turned off so that aioloader's budget, backoff
and retry counts apply here as to HTTP (`Storage` retries what `_mapped` calls retryable);
what retrying cannot mend (a missing key, refused access, a range past the end: the 4xx
family) fails at once.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .._errors import FetchError
from ._interface import Resumed, Versioned
from ._limits import check_range, too_large
from ._retry import Retryable, is_retryable
from ._version import Version, changed

if TYPE_CHECKING:
    from ._interface import StoreSettings

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>(\w+)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")


@dataclass(frozen=True)
class Cloud:
    """How one cloud's URLs name an object: `scheme://bucket/key`, the bucket (a container on
    Azure) named by the cloud's rules."""

    name: str
    schemes: str
    extra: str
    """The extra that installs obstore for it."""
    bucket: re.Pattern[str]
    rules: str
    word: str = "bucket"

    def split(self, url: str, prefix: bool = False) -> tuple[str, str]:
        """(bucket, key) of a URL, the key taken literally as the stores take keys (`?` and
        `#` belong to it). A ValueError naming the URL for what the store would read as
        another thing than meant: a bucket name against the rules, no key (a GET of the
        bucket is its listing), an empty path segment. A `prefix` may be empty (the whole
        bucket) and end in `/`. Azure's `container@account.host` keeps its account."""
        scheme, _, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        if not self.bucket.fullmatch(bucket.partition("@")[0]):
            raise ValueError(
                f"{url!r}: {self.word} name {bucket.partition('@')[0]!r} breaks "
                f"{self.name}'s naming rules ({self.rules})"
            )
        segments = key.split("/")
        if not prefix and not key:
            raise ValueError(f"{url!r} has no object key: give {scheme}://{bucket}/KEY")
        if "" in (segments[:-1] if prefix else segments):
            raise ValueError(f"{url!r} has an empty path segment (// or a key ending in /)")
        return bucket, key


S3 = Cloud("S3", "s3://", "s3", re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]"),
           "3 to 63 lowercase letters, digits, dots and hyphens, starting and ending with a "
           "letter or digit")
GCS = Cloud("Google Cloud Storage", "gs://", "gcs",
            re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"),
            "3 to 222 lowercase letters, digits, dots, hyphens and underscores, starting and "
            "ending with a letter or digit")
AZURE = Cloud("Azure", "az:// and abfs://", "azure",
              re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}"),
              "3 to 63 lowercase letters, digits and single hyphens, starting and ending with "
              "a letter or digit", word="container")


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


def import_obstore(cloud: Cloud) -> Any:
    try:
        import obstore
    except ImportError as e:
        raise ImportError(
            f"obstore is needed for {cloud.schemes} URLs: pip install 'aioloader[{cloud.extra}]' "
            f"({e})"
        ) from None
    return obstore


class ObjectStore:
    """One obstore store per bucket, made on first use; what differs between clouds is the
    URL's form (`cloud`) and how a store is made from the environment (`make`)."""

    cloud: ClassVar[Cloud]

    def __init__(self, settings: StoreSettings) -> None:
        self._policy = settings.policy
        self._counters = settings.counters
        self._max_bytes = settings.max_object_bytes
        self._stores: dict[str, Any] = {}
        self._obstore = import_obstore(self.cloud)
        errors = self._obstore.exceptions
        self._final = (
            FileNotFoundError, errors.NotFoundError, errors.PermissionDeniedError,
            errors.UnauthenticatedError, errors.PreconditionError, errors.NotModifiedError,
            errors.InvalidPathError, errors.NotSupportedError,
            errors.UnknownConfigurationKeyError,
        )

    @classmethod
    def make(cls, bucket: str, client_options: Any) -> Any:
        """An obstore store for `bucket`, configured from the environment."""
        raise NotImplementedError

    @classmethod
    def _store(cls, bucket: str, timeout: float | None = None) -> Any:
        import_obstore(cls.cloud)
        client_options: Any = {}
        if timeout is not None:
            client_options["timeout"] = f"{timeout}s"
        return cls.make(bucket, client_options)

    def _locate(self, url: str) -> tuple[Any, str]:
        bucket, key = self.cloud.split(url)
        if bucket not in self._stores:
            self._stores[bucket] = self._store(bucket, self._policy.timeout)
        return self._stores[bucket], key

    @contextmanager
    def _mapped(self, url: str) -> Iterator[None]:
        """The one boundary where obstore's errors become final (a FetchError: a missing key,
        refused access, a range past the end; obstore 0.12 raises a plain FileNotFoundError
        for a missing key, a GenericError for a 416) or `Retryable`."""
        try:
            yield
        except FetchError:
            raise
        except Exception as e:
            reason, status = _reason(e)
            if isinstance(e, self._final) or (status is not None and not is_retryable(status)):
                raise FetchError(url, reason, status) from e
            raise Retryable(f"{type(e).__name__}: {reason}", status) from e

    async def read(self, url: str, start: int | None = None, end: int | None = None) -> bytes:
        check_range(url, start, end, self._max_bytes)
        store, key = self._locate(url)
        with self._mapped(url):
            self._counters.requests += 1
            if start is None:
                result = await self._obstore.get_async(store, key)
                self._check_size(url, int(result.meta["size"]))
                return bytes(await result.bytes_async())
            return bytes(await self._obstore.get_range_async(store, key, start=start, end=end))

    async def read_versioned(self, url: str, start: int | None = None, end: int | None = None,
                             unless: Version | None = None) -> Versioned | None:
        """As `read`, with the object's version; None when its ETag is still `unless`'s
        (If-None-Match: a 304 without a body). Every cloud here sends ETags."""
        check_range(url, start, end, self._max_bytes)
        store, key = self._locate(url)
        options: dict[str, Any] = {}
        if start is not None:
            options["range"] = {"offset": start} if end is None else (start, end)
        if unless is not None and unless.etag is not None:
            options["if_none_match"] = unless.etag
        with self._mapped(url):
            self._counters.requests += 1
            try:
                result = await self._obstore.get_async(store, key, options=options)
            except self._obstore.exceptions.NotModifiedError:
                return None
            if start is None:
                self._check_size(url, int(result.meta["size"]))
            data = bytes(await result.bytes_async())
        if start is not None and end is not None and len(data) != end - start:
            raise FetchError(url, f"short read: wanted bytes {start}..{end}, got {len(data)}")
        return Versioned(data, _version(result.meta))

    async def size(self, url: str) -> int:
        store, key = self._locate(url)
        with self._mapped(url):
            self._counters.requests += 1
            return int((await self._obstore.head_async(store, key))["size"])

    async def stream(self, url: str, start: int, end: int | None, chunk_size: int,
                     resumed: Resumed) -> AsyncGenerator[bytes, None]:
        """A resume asks If-Match the first answer's ETag, and checks the answer's size. Not
        bound by max_object_bytes: a stream holds one chunk at a time."""
        store, key = self._locate(url)
        began = resumed.began
        options: dict[str, Any] = {"range": {"offset": start} if end is None else (start, end)}
        if began is not None and began.etag is not None:
            options["if_match"] = began.etag
        with self._mapped(url):
            self._counters.requests += 1
            try:
                result = await self._obstore.get_async(store, key, options=options)
            except self._obstore.exceptions.PreconditionError as e:  # If-Match refused
                raise changed(url, start, f"it no longer matches {began}") from e
            now = _version(result.meta)
            if began is not None:
                began.check(url, now, start)
            resumed.began = began or now
            async for chunk in result.stream(min_chunk_size=chunk_size):
                yield bytes(chunk)

    def _check_size(self, url: str, size: int) -> None:
        """Refuse, before its body is read, an answer that would take a read (or a stream,
        counted from where it began) past max_object_bytes."""
        if size > self._max_bytes:
            raise too_large(url, self._max_bytes, f"the object has {size} bytes to read")



    @classmethod
    def list(cls, prefix: str) -> list[str]:
        """URLs of every object under `scheme://bucket/prefix` (the prefix may be empty: the
        whole bucket), in key order."""
        obstore = import_obstore(cls.cloud)
        bucket, key_prefix = cls.cloud.split(prefix, prefix=True)
        store = cls._store(bucket)
        try:
            keys = [item["path"] for batch in obstore.list(store, key_prefix or None)
                    for item in batch]
        except Exception as e:
            reason, status = _reason(e)
            raise FetchError(prefix, f"{reason} (listing the prefix)", status) from e
        scheme = prefix.partition("://")[0]
        return [f"{scheme}://{bucket}/{key}" for key in sorted(keys)]

    async def aclose(self) -> None:
        """Nothing to close: obstore's connections go with its stores."""


def _allow_http(client_options: Any, *endpoints: str) -> Any:
    """The options with plain HTTP allowed when an endpoint variable names an http:// URL (an
    emulator, MinIO) or the cloud's ALLOW_HTTP variable is set: options given to obstore
    replace what it would read from the environment."""
    if any(os.environ.get(name, "").lower().startswith("http://") for name in endpoints[:-1]) \
            or os.environ.get(endpoints[-1], "").lower() in ("1", "true"):
        return {**client_options, "allow_http": True}
    return client_options


class S3Store(ObjectStore):
    cloud = S3

    @classmethod
    def make(cls, bucket: str, client_options: Any) -> Any:
        from obstore.store import S3Store as Store

        options = _allow_http(client_options, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL",
                              "AWS_ALLOW_HTTP")
        return Store(bucket, client_options=options, retry_config={"max_retries": 0})


class GCSStore(ObjectStore):
    cloud = GCS

    @classmethod
    def make(cls, bucket: str, client_options: Any) -> Any:
        from obstore.store import GCSStore as Store

        options = _allow_http(client_options, "GOOGLE_BASE_URL", "GOOGLE_ALLOW_HTTP")
        return Store(bucket, client_options=options, retry_config={"max_retries": 0})


class AzureStore(ObjectStore):
    cloud = AZURE

    @classmethod
    def make(cls, bucket: str, client_options: Any) -> Any:
        """`container`, or `container@account.dfs.core.windows.net` (abfs://): the account
        from the URL, else from AZURE_STORAGE_ACCOUNT_NAME."""
        from obstore.store import AzureStore as Store

        container, _, host = bucket.partition("@")
        account: Any = {"account_name": host.partition(".")[0]} if host else None
        options = _allow_http(client_options, "AZURE_STORAGE_ENDPOINT", "AZURITE_BLOB_STORAGE_URL",
                              "AZURE_ALLOW_HTTP")
        return Store(container, client_options=options, retry_config={"max_retries": 0},
                     config=account)


def _version(meta: Any) -> Version:
    """The object's ETag, Last-Modified and size as a get's metadata gives them (its size is
    the whole object's, also for a range)."""
    return Version(meta["e_tag"], meta["last_modified"].isoformat(), int(meta["size"]))
