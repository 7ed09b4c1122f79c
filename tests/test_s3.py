"""s3:// through obstore, against moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from recordio_cases import IMAGE_HEADERS, payloads

import aioloader
from aioloader import FetchError, recordio
from aioloader.storage._storage import Storage

from conftest import moto_server
from decoders import SAMPLE_COUNT, index_of, sample_bytes

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def bucket(s3_endpoint: str) -> str:
    """A bucket with the samples, the golden .rec/.idx and two tar shards."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="training")
    for i in range(SAMPLE_COUNT):
        client.put_object(Bucket="training", Key=f"samples/{i:04d}.bin", Body=sample_bytes(i))
    for name in ("golden.rec", "golden.idx"):
        client.put_object(Bucket="training", Key=f"rec/{name}", Body=(DATA / name).read_bytes())
    for shard in range(2):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for i in range(shard * 5, shard * 5 + 5):
                info = tarfile.TarInfo(f"{i:03d}.cls")
                info.size = len(str(i))
                tar.addfile(info, io.BytesIO(str(i).encode()))
        client.put_object(Bucket="training", Key=f"tar/{shard}.tar", Body=buffer.getvalue())
    return "s3://training/"


def test_objects_load_through_the_decode_pool(bucket: str) -> None:
    files = aioloader.Files(f"{bucket}samples/{i:04d}.bin" for i in range(SAMPLE_COUNT))
    with aioloader.Loader(files, decode=index_of, batch_size=16, shuffle=True) as loader:
        seen = sorted(int(i) for batch in loader for i in batch)
    assert seen == list(range(SAMPLE_COUNT))


def test_a_prefix_lists_into_a_files_dataset(bucket: str) -> None:
    files = aioloader.Files.from_prefix(bucket + "samples/")
    assert len(files) == SAMPLE_COUNT and files.key(7) == f"{bucket}samples/0007.bin"


def test_missing_key_names_the_url(bucket: str) -> None:
    files = aioloader.Files([bucket + "samples/nope.bin"])
    with pytest.raises(aioloader.LoaderError, match=r"s3://training/samples/nope\.bin.*404"):
        list(aioloader.Loader(files, num_workers=0))


@pytest.mark.parametrize("with_index", [True, False])
def test_recordio_reads_ranges_from_s3(bucket: str, with_index: bool) -> None:
    golden = [*payloads(), *(recordio.pack(recordio.IRHeader(*h), p) for h, p in IMAGE_HEADERS)]
    dataset = aioloader.RecordIO(bucket + "rec/golden.rec",
                                 bucket + "rec/golden.idx" if with_index else None)
    loader = aioloader.Loader(dataset, batch_size=None, num_workers=0)
    assert list(loader) == golden


def test_tar_shards_stream_from_s3(bucket: str) -> None:
    def label(sample: dict[str, Any]) -> int:
        return int(sample["cls"])

    shards = aioloader.TarShards(bucket + "tar/{0..1}.tar")
    samples = list(aioloader.Loader(shards, batch_size=None, num_workers=0))
    assert [label(s) for s in samples] == list(range(10))
    assert samples[0]["__url__"] == bucket + "tar/0.tar"


@pytest.fixture(scope="module")
def locked_endpoint(s3_endpoint: str) -> Iterator[str]:
    """A second moto server, one that checks credentials: it knows none, so it refuses all."""
    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) as endpoint:
        yield endpoint


async def attempt(reads: Storage, how: str, url: str) -> None:
    if how == "read":
        await reads.read(url)
    elif how == "range":
        await reads.read_range(url, 10_000, 10_010)
    elif how == "size":
        await reads.size(url)
    else:
        assert b"".join([chunk async for chunk in reads.stream(url)])


@pytest.mark.parametrize(
    ("how", "key", "status"),
    [
        ("read", "training/samples/nope.bin", 404),
        ("size", "training/samples/nope.bin", 404),
        ("stream", "training/samples/nope.bin", 404),
        ("read", "no-such-bucket/0001.bin", 404),
        ("range", "training/samples/0001.bin", 416),
    ],
    ids=["missing key", "missing key (HEAD)", "missing key (stream)", "missing bucket",
         "range past the end"],
)
async def test_s3_refusals_fail_at_once_without_retries(
    bucket: str, how: str, key: str, status: int
) -> None:
    url = f"s3://{key}"
    async with Storage(retries=3) as reads:
        with pytest.raises(FetchError) as caught:
            await attempt(reads, how, url)
    assert caught.value.status == status and url in str(caught.value)
    assert reads.counters.retries == 0


async def test_s3_permission_denied_fails_at_once_without_retries(
    bucket: str, locked_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", locked_endpoint)
    async with Storage(retries=3) as reads:
        with pytest.raises(FetchError) as caught:
            await reads.read(bucket + "samples/0001.bin")
    assert caught.value.status == 403 and "samples/0001.bin" in str(caught.value)
    assert reads.counters.retries == 0


async def test_s3_object_over_max_object_bytes_is_refused_without_retry(bucket: str) -> None:
    url = bucket + "samples/0042.bin"  # 146 bytes
    async with Storage(retries=3, max_object_bytes=120) as reads:
        with pytest.raises(FetchError, match=r"0042\.bin.*120"):
            await attempt(reads, "read", url)
        assert await reads.read(bucket + "samples/0000.bin") == sample_bytes(0)  # 104 bytes
        assert await reads.read_range(url, 0, 100) == sample_bytes(42)[:100]
    assert reads.counters.retries == 0
