"""FaultyProxy: the test server's faults in front of any server on loopback. Storage reads
s3:// through it in front of moto's S3 server, and http:// in front of a TestServer."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from aioloader import FetchError
from aioloader.storage._storage import Storage
from aioloader.testing import FaultyProxy, TestServer

from conftest import moto_server
from decoders import SAMPLE_COUNT, sample_bytes

MiB = 1 << 20
BIG = random.Random(7).randbytes(24 * MiB)
"""An object of tens of MB, no two of its ranges alike."""


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str) -> str:
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="proxied")
    for i in range(SAMPLE_COUNT):
        client.put_object(Bucket="proxied", Key=f"samples/{i:04d}.bin", Body=sample_bytes(i))
    client.put_object(Bucket="proxied", Key="big.bin", Body=BIG)
    return "s3://proxied/"


@pytest.fixture
def s3_proxy(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultyProxy]:
    """A proxy in front of moto, AWS_ENDPOINT_URL pointing at it for this test only."""
    with FaultyProxy(s3_endpoint, seed=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url.rstrip("/"))
        yield proxy


async def test_s3_reads_get_the_right_bytes_through_503s_and_resets(
    bucket: str, s3_proxy: FaultyProxy
) -> None:
    s3_proxy.set_faults(error_rate=0.15, drop_rate=0.15)
    urls = [f"{bucket}samples/{i:04d}.bin" for i in range(SAMPLE_COUNT)]
    async with Storage() as reads:
        whole = await asyncio.gather(*(reads.read(url) for url in urls))
        ranges = await asyncio.gather(*(reads.read_range(url, 3, 90) for url in urls))
        big = await reads.read(bucket + "big.bin")
        big_range = await reads.read_range(bucket + "big.bin", 5_000_001, 17_000_000)
    assert whole == [sample_bytes(i) for i in range(SAMPLE_COUNT)]
    assert ranges == [sample_bytes(i)[3:90] for i in range(SAMPLE_COUNT)]
    assert big == BIG and big_range == BIG[5_000_001:17_000_000]
    stats = s3_proxy.stats()
    assert stats["errors"] > 0 and stats["drops"] > 0 and reads.counters.retries > 0


async def test_s3_read_answered_503_every_time_fails_naming_the_url_and_the_503(
    bucket: str, s3_proxy: FaultyProxy
) -> None:
    s3_proxy.set_faults(error_rate=1.0)
    url = bucket + "samples/0003.bin"
    async with Storage(retries=2, hedge=False) as reads:
        with pytest.raises(FetchError) as caught:
            await reads.read(url)
    assert caught.value.status == 503 and url in str(caught.value) and "503" in str(caught.value)
    assert reads.counters.retries == 2 and s3_proxy.stats()["errors"] == 3


async def test_signed_s3_requests_through_the_proxy_pass_a_server_that_checks_signatures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Host header goes on as signed (the proxy's): a moto that checks signatures takes
    uploads and reads sent through the proxy, and still refuses a wrong secret."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("obstore")
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    # the first three requests (making a user, its policy and its key) go unchecked
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as endpoint:
        iam = boto3.client("iam", endpoint_url=endpoint)
        iam.create_user(UserName="trainer")
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        with FaultyProxy(endpoint) as proxy:
            through = proxy.url.rstrip("/")
            client = boto3.client("s3", endpoint_url=through,
                                  aws_access_key_id=key["AccessKeyId"],
                                  aws_secret_access_key=key["SecretAccessKey"])
            client.create_bucket(Bucket="signed")
            client.put_object(Bucket="signed", Key="big.bin", Body=BIG[: 5 * MiB])
            monkeypatch.setenv("AWS_ENDPOINT_URL", through)
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
            async with Storage() as reads:
                assert await reads.read("s3://signed/big.bin") == BIG[: 5 * MiB]
                assert await reads.read_range("s3://signed/big.bin", 7, 70_007) == BIG[7:70_007]
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
            async with Storage(retries=0) as reads:
                with pytest.raises(FetchError, match="SignatureDoesNotMatch") as caught:
                    await reads.read("s3://signed/big.bin")
            assert caught.value.status == 403


@pytest.fixture
def http_proxy(faulty_server: TestServer) -> Iterator[FaultyProxy]:
    with FaultyProxy(faulty_server.url, seed=2) as proxy:
        yield proxy


async def test_http_reads_get_the_right_bytes_through_503s_429s_and_resets(
    leak_check: None, faulty_server: TestServer, http_proxy: FaultyProxy
) -> None:
    """Leaves no process or socket behind once the proxy and the server are closed."""
    http_proxy.set_faults(error_rate=0.15, throttle_rate=0.1, drop_rate=0.15)
    urls = [f"{http_proxy.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)]
    async with Storage() as reads:
        whole = await asyncio.gather(*(reads.read(url) for url in urls))
        ranges = await asyncio.gather(*(reads.read_range(url, 3, 90) for url in urls))
    assert whole == [sample_bytes(i) for i in range(SAMPLE_COUNT)]
    assert ranges == [sample_bytes(i)[3:90] for i in range(SAMPLE_COUNT)]
    stats = http_proxy.stats()
    assert min(stats["errors"], stats["throttles"], stats["drops"], reads.counters.retries) > 0
    assert faulty_server.stats().get("errors", 0) == 0  # the faults were the proxy's


def fetch(url: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, str], bytes]:
    """Status, the end-to-end headers that say what the body is, and the body."""
    request = urllib.request.Request(url, method=method, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=10)
    except urllib.error.HTTPError as e:
        response = e
    with response:
        body = response.read()
    names = ("Content-Length", "Content-Range", "ETag", "Last-Modified", "Accept-Ranges")
    return response.status, {n: response.headers[n] for n in names if n in response.headers}, body


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("GET", "0007.bin", {}),
        ("GET", "0007.bin", {"Range": "bytes=10-49"}),
        ("GET", "0007.bin", {"Range": "bytes=-5"}),
        ("GET", "0007.bin", {"Range": "bytes=10-49", "If-Range": '"another-version"'}),
        ("GET", "0007.bin", {"Range": "bytes=5000-"}),
        ("HEAD", "0007.bin", {}),
        ("GET", "nope.bin", {}),
    ],
    ids=["whole", "range", "suffix range", "If-Range of another version", "range past the end",
         "HEAD", "missing"],
)
def test_answers_pass_the_proxy_as_the_server_sent_them(
    faulty_server: TestServer, http_proxy: FaultyProxy, method: str, path: str,
    headers: dict[str, str],
) -> None:
    direct = fetch(faulty_server.url + path, method, **headers)
    assert fetch(http_proxy.url + path, method, **headers) == direct
    assert direct[0] in (200, 206, 404, 416)


def test_a_drop_sends_half_the_body_then_closes_the_connection(
    http_proxy: FaultyProxy,
) -> None:
    http_proxy.set_faults(drop_rate=1.0)
    whole = sample_bytes(40)
    for headers, body in [({}, whole), ({"Range": "bytes=4-103"}, whole[4:104])]:
        connection = http.client.HTTPConnection("127.0.0.1", http_proxy.port, timeout=10)
        try:
            connection.request("GET", "/0040.bin", headers=headers)
            response = connection.getresponse()
            with pytest.raises(http.client.IncompleteRead) as caught:
                response.read()
        finally:
            connection.close()
        assert caught.value.partial == body[: len(body) // 2]
    assert http_proxy.stats()["drops"] == 2


def test_a_503_from_the_proxy_never_reaches_the_upstream(
    faulty_server: TestServer, http_proxy: FaultyProxy
) -> None:
    before = faulty_server.stats().get("requests", 0)
    http_proxy.set_faults(error_rate=1.0, retry_after=3)
    for i in range(5):
        status, _, _ = fetch(f"{http_proxy.url}{i:04d}.bin")
        assert status == 503
    assert faulty_server.stats().get("requests", 0) == before
    assert http_proxy.stats()["errors"] == 5


def test_a_body_streams_through_without_waiting_for_its_end(
    faulty_server: TestServer, http_proxy: FaultyProxy
) -> None:
    """/_hostile/endless never ends: a proxy that held bodies whole would send nothing."""
    wanted = 64 * MiB
    with urllib.request.urlopen(http_proxy.url + "_hostile/endless", timeout=10) as response:
        received = 0
        while received < wanted:
            chunk = response.read(min(MiB, wanted - received))
            assert chunk[:251] == bytes((received + i) % 251 for i in range(min(251, len(chunk))))
            received += len(chunk)
    assert http_proxy.stats()["requests"] == 1  # and it still answers


@pytest.mark.parametrize(
    "upstream",
    ["http://10.1.2.3:9000", "http://example.com/", "http://127.0.0.1.example.com/",
     "https://127.0.0.1:9000", "ftp://localhost/"],
)
def test_proxy_refuses_an_upstream_off_loopback(upstream: str) -> None:
    with pytest.raises(ValueError, match="only to http:// on loopback.*" + re.escape(upstream)):
        FaultyProxy(upstream)


def test_proxy_refuses_faults_it_cannot_apply(http_proxy: FaultyProxy) -> None:
    with pytest.raises(ValueError, match="cannot apply ignore_ranges"):
        FaultyProxy(http_proxy.url, ignore_ranges=True)
    with pytest.raises(urllib.error.HTTPError, match="400"):
        http_proxy.set_faults(error_rate=0.5, shift_ranges=3)
    assert http_proxy.set_faults()["error_rate"] == 0.0


def test_an_upstream_that_is_down_gets_a_502_naming_it() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with FaultyProxy(f"http://127.0.0.1:{port}/") as proxy:
        status, _, body = fetch(proxy.url + "0001.bin")
        assert status == 502 and f"127.0.0.1:{port}" in body.decode()
        assert proxy.stats()["upstream_failures"] == 1
