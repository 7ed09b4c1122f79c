"""One store interface, one registry from URL scheme to store: every scheme resolves to a store
with the whole interface, URLs are checked before any read, an unknown scheme names those that
work, and listing works wherever the store can list."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import aioloader
from aioloader.storage import _registry
from aioloader.storage._storage import Storage

INTERFACE = ("read", "read_versioned", "size", "stream", "list", "aclose")


@pytest.mark.parametrize("scheme", sorted(_registry.SCHEMES))
def test_every_registered_scheme_resolves_to_a_store_with_the_whole_interface(
    scheme: str,
) -> None:
    store = _registry.store_class(f"{scheme}://bucket/key" if scheme else "some/path")
    missing = [name for name in INTERFACE if not callable(getattr(store, name, None))]
    assert not missing, f"{store.__name__} for {scheme!r} lacks {missing}"
    assert list(inspect.signature(store).parameters) == ["settings"]


def test_an_unknown_scheme_names_every_scheme_that_works() -> None:
    with pytest.raises(ValueError, match=r"unknown URL scheme 'ftp'") as refused:
        aioloader.Files(["ftp://example/x.bin"])
    for scheme in ("file://", "http://", "https://", "s3://", "gs://", "az://", "abfs://"):
        assert scheme in str(refused.value)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs://Upper_Case/x.jpg", r"bucket name 'Upper_Case' breaks Google Cloud Storage's"),
        ("gs://bucket/", r"has no object key: give gs://bucket/KEY"),
        ("gs://bucket/a//b.jpg", r"empty path segment"),
        ("az://double--hyphen/x.jpg", r"container name 'double--hyphen' breaks Azure's"),
        ("abfs://data@account.dfs.core.windows.net/", r"no object key"),
        ("s3://a/x.jpg", r"bucket name 'a' breaks S3's"),
    ],
)
def test_cloud_urls_the_store_would_misread_are_refused_when_the_dataset_is_built(
    url: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        aioloader.Files([url])


def test_azure_urls_keep_the_account_an_abfs_url_names() -> None:
    from aioloader.storage._object import AZURE

    assert AZURE.split("abfs://data@acct.dfs.core.windows.net/train/0.jpg") == (
        "data@acct.dfs.core.windows.net", "train/0.jpg")
    assert AZURE.split("az://data/train/0.jpg") == ("data", "train/0.jpg")


def make_tree(root: Path) -> list[Path]:
    files = [root / "train" / "a" / "1.bin", root / "train" / "b.bin", root / "train-x.bin",
             root / "val" / "2.bin"]
    for n, path in enumerate(files):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([n]))
    return files


def test_a_local_folder_lists_at_any_depth_in_order(tmp_path: Path) -> None:
    make_tree(tmp_path)
    files = aioloader.Files.from_prefix(f"{tmp_path}/train/")
    assert [files.key(i) for i in range(len(files))] == [
        f"{tmp_path}/train/a/1.bin", f"{tmp_path}/train/b.bin"]
    by_name = aioloader.Files.from_prefix(f"{tmp_path}/train")  # whole segments, as obstore
    assert [by_name.key(i) for i in range(len(by_name))] == [files.key(0), files.key(1)]


def test_a_folder_linked_back_up_is_listed_once(tmp_path: Path) -> None:
    make_tree(tmp_path)
    (tmp_path / "train" / "a" / "up").symlink_to(tmp_path / "train")
    assert len(aioloader.Files.from_prefix(f"{tmp_path}/train/")) == 2


def test_a_file_url_prefix_lists_file_urls_that_read_back(tmp_path: Path) -> None:
    folder = tmp_path / "with space"
    make_tree(folder)
    files = aioloader.Files.from_prefix(f"file://{folder}/val/".replace(" ", "%20"))
    assert files.key(0) == f"file://{folder}/val/2.bin".replace(" ", "%20")
    assert list(aioloader.Loader(files, num_workers=0, batch_size=None)) == [bytes([3])]


def test_a_missing_local_folder_is_a_fetch_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(aioloader.FetchError, match="no folder"):
        aioloader.Files.from_prefix(f"{tmp_path}/absent/")


def test_http_has_no_listing() -> None:
    with pytest.raises(ValueError, match="HTTP has no listing"):
        aioloader.Files.from_prefix("http://127.0.0.1:1/data/")


async def test_a_storage_makes_one_store_per_class_and_closes_them_all(
    tmp_path: Path,
) -> None:
    (tmp_path / "x.bin").write_bytes(b"here")
    async with Storage() as reads:
        assert await reads.read(str(tmp_path / "x.bin")) == b"here"
        assert await reads.read(f"file://{tmp_path}/x.bin") == b"here"
        assert reads._store("http://127.0.0.1:1/a") is reads._store("https://127.0.0.1:1/b")
        assert reads._store("az://data/a") is reads._store("abfs://data/b")
        assert len(reads._stores) == 3  # local, http(s), azure
