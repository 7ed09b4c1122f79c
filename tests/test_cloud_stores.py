"""Every object store through the one storage interface, each against its emulator on
127.0.0.1 (moto for s3://, fake-gcs-server for gs://, Azurite for az:// and abfs://): Files,
TarShards, RecordIO (ranged reads) and Parquet read the same, listing works, errors name the
URL; and through a fault proxy in front of each, 503s and resets cost retries, not data."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from recordio_cases import IMAGE_HEADERS, payloads

import aioloader
from aioloader import recordio
from aioloader.testing import FaultyProxy

from decoders import SAMPLE_COUNT, index_of, sample_bytes
from emulators import (
    Emulator,
    azure_environment,
    azure_upload,
    azurite,
    environment,
    gcs_emulator,
    gcs_environment,
    gcs_upload,
)

DATA = Path(__file__).parent / "data"
BUCKET = "clouds"
ROWS = 50


def parquet_bytes() -> bytes:
    """50 rows in row groups of 7 (the last one shorter)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(ROWS)), "name": [f"row {i}" for i in range(ROWS)]}),
                   buffer, row_group_size=7)
    return buffer.getvalue()


def tar_shard(first: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i in range(first, first + 5):
            info = tarfile.TarInfo(f"{i:03d}.cls")
            info.size = len(str(i))
            tar.addfile(info, io.BytesIO(str(i).encode()))
    return buffer.getvalue()


def objects() -> dict[str, bytes]:
    found = {f"samples/{i:04d}.bin": sample_bytes(i) for i in range(SAMPLE_COUNT)}
    found.update({f"rec/{name}": (DATA / name).read_bytes()
                  for name in ("golden.rec", "golden.idx")})
    found.update({f"tar/{shard}.tar": tar_shard(shard * 5) for shard in range(2)})
    found["table/rows.parquet"] = parquet_bytes()
    return found


@pytest.fixture(scope="module")
def s3_store(s3_endpoint: str) -> str:
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=BUCKET)
    for key, body in objects().items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
    return f"s3://{BUCKET}/"


@pytest.fixture(scope="module")
def gcs() -> Iterator[Emulator]:
    with gcs_emulator() as running:
        gcs_upload(running.url, BUCKET, objects())
        yield running


@pytest.fixture(scope="module")
def azure() -> Iterator[Emulator]:
    with azurite() as running:
        azure_upload(running.url, BUCKET, objects())
        yield running


@pytest.fixture
def gs_store(gcs: Emulator) -> Iterator[str]:
    with environment(gcs.environment):
        yield f"gs://{BUCKET}/"


@pytest.fixture
def az_store(azure: Emulator) -> Iterator[str]:
    with environment(azure.environment):
        yield f"az://{BUCKET}/"


@pytest.fixture
def abfs_store(azure: Emulator) -> Iterator[str]:
    with environment(azure.environment):
        yield f"abfs://{BUCKET}@devstoreaccount1.dfs.core.windows.net/"


@pytest.fixture(params=["s3", "gs", "az", "abfs"])
def store(request: pytest.FixtureRequest) -> str:
    """The bucket's URL on each store, its variables set."""
    url: str = request.getfixturevalue(f"{request.param}_store")
    return url


def test_files_load_through_the_decode_pool(store: str) -> None:
    files = aioloader.Files(f"{store}samples/{i:04d}.bin" for i in range(SAMPLE_COUNT))
    with aioloader.Loader(files, decode=index_of, batch_size=16, shuffle=True,
                          num_workers=2) as loader:
        assert sorted(int(i) for batch in loader for i in batch) == list(range(SAMPLE_COUNT))


def test_a_prefix_lists_in_key_order(store: str) -> None:
    files = aioloader.Files.from_prefix(store + "samples/")
    assert len(files) == SAMPLE_COUNT and files.key(7) == f"{store}samples/0007.bin"


def test_a_missing_key_names_the_url_and_the_404(store: str) -> None:
    files = aioloader.Files([store + "samples/nope.bin"])
    with pytest.raises(aioloader.LoaderError, match=r"samples/nope\.bin.*404"):
        list(aioloader.Loader(files, num_workers=0))


@pytest.mark.parametrize("with_index", [True, False])
def test_recordio_reads_ranges(store: str, with_index: bool) -> None:
    golden = [*payloads(), *(recordio.pack(recordio.IRHeader(*h), p) for h, p in IMAGE_HEADERS)]
    dataset = aioloader.RecordIO(store + "rec/golden.rec",
                                 store + "rec/golden.idx" if with_index else None)
    assert list(aioloader.Loader(dataset, batch_size=None, num_workers=0)) == golden


def test_tar_shards_stream(store: str) -> None:
    shards = aioloader.TarShards(store + "tar/{0..1}.tar")
    samples = list(aioloader.Loader(shards, batch_size=None, num_workers=0))
    assert [int(s["cls"]) for s in samples] == list(range(10))
    assert samples[0]["__url__"] == store + "tar/0.tar"


def test_parquet_gives_every_row_of_uneven_row_groups(store: str) -> None:
    rows: list[Any] = list(aioloader.Loader(aioloader.Parquet(store + "table/rows.parquet"),
                                            batch_size=None, num_workers=0))
    assert [int(row["id"]) for row in rows] == list(range(ROWS))
    assert rows[49]["name"] == "row 49"


@pytest.fixture(params=["s3", "gs", "az"])
def faulty_store(request: pytest.FixtureRequest) -> Iterator[tuple[str, FaultyProxy]]:
    """The bucket's URL on each store, through a proxy that answers 503 to a fifth of the
    requests and cuts a fifth of the answers off half-way (a reset)."""
    kind = request.param
    upstream = {"s3": lambda: request.getfixturevalue("s3_endpoint"),
                "gs": lambda: request.getfixturevalue("gcs").url,
                "az": lambda: request.getfixturevalue("azure").url}[kind]()
    if kind == "s3":
        request.getfixturevalue("s3_store")  # the objects
    with FaultyProxy(upstream, error_rate=0.2, drop_rate=0.2, seed=3) as proxy:
        through = proxy.url.rstrip("/")
        variables = {"s3": {"AWS_ENDPOINT_URL": through},
                     "gs": gcs_environment(through), "az": azure_environment(through)}[kind]
        monkeypatch = pytest.MonkeyPatch()
        try:
            with environment({}):
                for name, value in variables.items():
                    monkeypatch.setenv(name, value)
                yield f"{kind}://{BUCKET}/", proxy
        finally:
            monkeypatch.undo()


def test_503s_and_resets_cost_retries_not_data(faulty_store: tuple[str, FaultyProxy]) -> None:
    store, proxy = faulty_store
    files = aioloader.Files(f"{store}samples/{i:04d}.bin" for i in range(SAMPLE_COUNT))
    loader = aioloader.Loader(files, decode=index_of, batch_size=16, num_workers=0, retries=8,
                              hedge=False)
    with loader:
        assert [int(i) for batch in loader for i in batch] == list(range(SAMPLE_COUNT))
    assert loader.stats.retries > 0
    golden = [*payloads(), *(recordio.pack(recordio.IRHeader(*h), p) for h, p in IMAGE_HEADERS)]
    records = aioloader.RecordIO(store + "rec/golden.rec", store + "rec/golden.idx")
    assert list(aioloader.Loader(records, batch_size=None, num_workers=0, retries=8)) == golden
    shards = aioloader.TarShards(store + "tar/{0..1}.tar")
    samples = list(aioloader.Loader(shards, batch_size=None, num_workers=0, retries=8))
    assert [int(s["cls"]) for s in samples] == list(range(10))
    counts = proxy.stats()
    assert counts["errors"] > 0 and counts["drops"] > 0
