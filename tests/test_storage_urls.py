"""URLs read what they name, and resumed streams the object they began with: malformed s3:// and
file:// URLs refused up front, objects replaced mid-stream refused rather than spliced, failed
listings told in one line. Against the project's test server and moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader import FetchError
from aioloader.storage._storage import Storage, check_url
from aioloader.testing import TestServer

from conftest import moto_server

SHARD_BYTES = 256 << 10


def shard(seed: int, size: int = SHARD_BYTES) -> bytes:
    return random.Random(seed).randbytes(size)


async def rest_of(chunks: AsyncGenerator[bytes, None]) -> bytes:
    async with aclosing(chunks):
        return b"".join([chunk async for chunk in chunks])


def replace_file(path: Path, data: bytes) -> None:
    """A new file in its place (as an upload or `cp` would), dated a second later: enough for
    a server that only sends Last-Modified, whose resolution is a second."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    later = path.stat().st_mtime + 10
    os.utime(new, (later, later))
    os.replace(new, path)


# HTTP: a stream resumed after a dropped connection


@pytest.mark.parametrize(
    ("validators", "new_size"),
    [("etag", SHARD_BYTES), ("etag", SHARD_BYTES - 1000), ("last-modified", SHARD_BYTES)],
    ids=["same size", "shorter", "Last-Modified only"],
)
async def test_resumed_stream_refuses_a_changed_object(
    tmp_path: Path, validators: str, new_size: int
) -> None:
    path = tmp_path / "shard.tar"
    path.write_bytes(shard(1))
    with TestServer(tmp_path, drop_rate=1.0, no_etag=validators == "last-modified") as server:
        url = server.url + "shard.tar"
        async with Storage(retries=3) as reads:
            chunks = reads.stream(url, chunk_size=16 << 10)
            first = await anext(chunks)  # the server cuts this answer after half of the file
            assert first == shard(1)[: len(first)]
            replace_file(path, shard(2, new_size))
            await asyncio.to_thread(server.set_faults, drop_rate=0.0)
            with pytest.raises(FetchError, match="changed during the read") as caught:
                await rest_of(chunks)
    assert caught.value.url == url and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "faults",
    [{}, {"no_etag": True}, {"ignore_ranges": True}],
    ids=["ETag", "Last-Modified only", "ranges ignored"],
)
async def test_resumed_stream_reads_on_in_an_unchanged_object(
    tmp_path: Path, faults: dict[str, Any]
) -> None:
    (tmp_path / "shard.tar").write_bytes(shard(1))
    with TestServer(tmp_path, drop_rate=1.0, **faults) as server:
        async with Storage(retries=3) as reads:
            chunks = reads.stream(server.url + "shard.tar", chunk_size=16 << 10)
            first = await anext(chunks)  # the server cuts this answer after half of the file
            await asyncio.to_thread(server.set_faults, drop_rate=0.0)
            assert first + await rest_of(chunks) == shard(1)
        assert server.stats()["drops"] == 1 and reads.counters.retries == 1


# s3:// against moto


@pytest.fixture(scope="module")
def s3(s3_endpoint: str) -> Any:
    """A client of moto's S3 server with the bucket `urls` made."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="urls")
    return client


async def test_resumed_s3_stream_refuses_a_changed_object(s3: Any) -> None:
    s3.put_object(Bucket="urls", Key="changing.tar", Body=shard(1, 4 << 20))
    async with Storage(timeout=2.0, retries=3) as reads:
        chunks = reads.stream("s3://urls/changing.tar", chunk_size=64 << 10)
        await anext(chunks)
        await asyncio.to_thread(
            s3.put_object, Bucket="urls", Key="changing.tar", Body=shard(2, 4 << 20)
        )
        await asyncio.sleep(2.5)  # past the 2 s timeout: the rest of this answer fails
        with pytest.raises(FetchError, match="changed during the read") as caught:
            await rest_of(chunks)
    assert caught.value.url == "s3://urls/changing.tar" and "\n" not in str(caught.value)


async def test_resumed_s3_stream_reads_on_in_an_unchanged_object(s3: Any) -> None:
    s3.put_object(Bucket="urls", Key="steady.tar", Body=shard(1, 4 << 20))
    async with Storage(timeout=2.0, retries=3) as reads:
        chunks = reads.stream("s3://urls/steady.tar", chunk_size=64 << 10)
        first = await anext(chunks)
        await asyncio.sleep(2.5)  # past the 2 s timeout: the rest of this answer fails
        assert first + await rest_of(chunks) == shard(1, 4 << 20)
    assert reads.counters.retries >= 1


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://urls", "has no object key"),
        ("s3://urls/", "has no object key"),
        ("s3://urls//x.bin", "empty path segment"),
        ("s3://urls/a//x.bin", "empty path segment"),
        ("s3://urls/folder/", "empty path segment"),
        ("s3://ab/x.bin", "naming rules"),
        ("s3://" + "a" * 64 + "/x.bin", "naming rules"),
        ("s3://Urls/x.bin", "naming rules"),
        ("s3://my_bucket/x.bin", "naming rules"),
        ("s3://-urls/x.bin", "naming rules"),
        ("s3://urls./x.bin", "naming rules"),
        ("s3://urls:9000/x.bin", "naming rules"),
        ("s3:///x.bin", "naming rules"),
    ],
)
async def test_s3_url_naming_no_single_object_is_refused_before_any_request(
    s3: Any, url: str, problem: str
) -> None:
    s3.put_object(Bucket="urls", Key="x.bin", Body=b"x")
    with pytest.raises(ValueError, match=problem) as caught:
        check_url(url)
    assert repr(url) in str(caught.value)
    with pytest.raises(ValueError, match=problem):
        aioloader.Files([url])
    async with Storage(retries=0) as reads:
        with pytest.raises(ValueError, match=problem):
            await reads.read(url)
    assert reads.counters.requests == 0


async def test_s3_keys_are_read_literally_whatever_the_scheme_case(s3: Any) -> None:
    s3.put_object(Bucket="urls", Key="a?b#c.bin", Body=b"literal")
    s3.put_object(Bucket="urls", Key="a", Body=b"cut at ?")
    async with Storage() as reads:
        for url in ("s3://urls/a?b#c.bin", "S3://urls/a?b#c.bin"):
            assert await reads.read(check_url(url)) == b"literal"


def test_prefixes_still_list_the_bucket_or_a_folder(s3: Any) -> None:
    s3.create_bucket(Bucket="listed")
    for key in ("top.bin", "train/0.bin", "train/1.bin"):
        s3.put_object(Bucket="listed", Key=key, Body=b"x")
    whole = ["s3://listed/top.bin", "s3://listed/train/0.bin", "s3://listed/train/1.bin"]
    for prefix in ("s3://listed", "s3://listed/"):
        files = aioloader.Files.from_prefix(prefix)
        assert [files.key(i) for i in range(len(files))] == whole
    files = aioloader.Files.from_prefix("s3://listed/train/")
    assert [files.key(i) for i in range(len(files))] == whole[1:]
    with pytest.raises(ValueError, match="empty path segment"):
        aioloader.Files.from_prefix("s3://listed//train/")


@pytest.fixture
def refusing_endpoint(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto server that checks credentials and knows none, made the current endpoint."""
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        yield endpoint


def test_failed_listing_is_one_line_naming_the_prefix_and_the_cause(s3: Any) -> None:
    with pytest.raises(FetchError) as caught:
        aioloader.Files.from_prefix("s3://no-such-bucket/train/")
    message = str(caught.value)
    assert "s3://no-such-bucket/train/" in message and "NoSuchBucket" in message
    assert caught.value.status == 404 and "\n" not in message and len(message) < 300
    assert type(caught.value.__cause__).__module__.startswith("obstore")


def test_refused_credentials_listing_is_one_line_naming_the_prefix(
    refusing_endpoint: str,
) -> None:
    with pytest.raises(FetchError) as caught:
        aioloader.Files.from_prefix("s3://urls/")
    message = str(caught.value)
    assert "s3://urls/" in message and caught.value.status == 403
    assert "\n" not in message and len(message) < 300
    assert caught.value.__cause__ is not None


# file://


def test_file_url_naming_another_host_is_refused(tmp_path: Path) -> None:
    url = f"file://otherhost{tmp_path}/x.bin"
    with pytest.raises(ValueError, match="names the host 'otherhost'") as caught:
        check_url(url)
    assert repr(url) in str(caught.value)
    with pytest.raises(ValueError, match="names the host"):
        aioloader.Files([url])


async def test_file_urls_of_this_machine_are_read(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"here")
    async with Storage() as reads:
        for url in (f"file://{tmp_path}/x.bin", f"file://localhost{tmp_path}/x.bin",
                    f"file://LOCALHOST{tmp_path}/x.bin"):
            assert await reads.read(check_url(url)) == b"here"
        with pytest.raises(ValueError, match="names the host"):
            await reads.read(f"file://otherhost{tmp_path}/x.bin")
