"""Tar shards read as WebDataset itself reads them: each shard here, written by GNU tar or by
Python's tarfile with the oddities real shards carry, is read sample by sample by the
`webdataset` package and by `aioloader.TarShards`, and the two must agree on every key and every
byte."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from webdataset.tariterators import tarfile_samples

import aioloader


def webdataset_reads(path: Path) -> list[dict[str, Any]]:
    return [_content(s) for s in tarfile_samples([{"url": str(path)}])]


def aioloader_reads(path: Path) -> list[dict[str, Any]]:
    shards = aioloader.TarShards(str(path), index_dir=path.parent / "index")
    return [_content(s) for s in aioloader.Loader(shards, batch_size=None, num_workers=0)]


def _content(sample: dict[str, Any]) -> dict[str, Any]:
    """The key and each file of a sample (the URL's spelling is each reader's own)."""
    return {k: v for k, v in sample.items() if k == "__key__" or not k.startswith("__")}


def sparse_file(path: Path, pieces: int, size: int) -> None:
    """A file of `size` bytes, mostly holes, with `pieces` runs of data."""
    with open(path, "wb") as file:
        for n in range(pieces):
            file.seek(n * size // pieces)
            file.write(bytes([65 + n % 26]) * 1000)
        file.truncate(size)


def gnu_tar(folder: Path, shard: Path, names: list[str], *options: str) -> None:
    subprocess.run(["tar", "-C", str(folder), *options, "-cf", str(shard), *names], check=True)


def sparse_shard(*options: str) -> Callable[[Path], Path]:
    """Two samples of sparse files, one with more pieces than GNU's header holds (21 per
    extension block after 4 in the header), with their labels."""
    def make(tmp_path: Path) -> Path:
        files = tmp_path / "files"
        files.mkdir()
        sparse_file(files / "many.bin", pieces=30, size=1_300_000)
        sparse_file(files / "two.bin", pieces=2, size=1 << 20)
        (files / "many.cls").write_bytes(b"1")
        (files / "two.cls").write_bytes(b"2")
        shard = tmp_path / "sparse.tar"
        gnu_tar(files, shard, ["many.bin", "many.cls", "two.bin", "two.cls"], "--sparse",
                *options)
        return shard
    return make


def written(files: list[tuple[str, bytes]], format: int = tarfile.PAX_FORMAT
            ) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        shard = tmp_path / "written.tar"
        with tarfile.open(shard, "w", format=format) as tar:
            for name, data in files:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return shard
    return make


def pax_size(tmp_path: Path) -> Path:
    """A member whose size is in a pax header and 0 in its own (tar writes so past 8 GiB)."""
    record = b" size=4\n"
    record = str(len(record) + 2).encode() + record
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, len(record)
    member = tarfile.TarInfo("k.txt")
    shard = tmp_path / "pax-size.tar"
    shard.write_bytes(pax.tobuf(tarfile.GNU_FORMAT) + record + bytes(512 - len(record))
                      + member.tobuf(tarfile.GNU_FORMAT) + b"text" + bytes(508)
                      + written_bytes([("l.txt", b"next")]))
    return shard


def written_bytes(files: list[tuple[str, bytes]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def odd_tree(tmp_path: Path) -> Path:
    """What a folder packed by GNU tar holds: dotted keys, upper-case and several extensions,
    a directory, a file without an extension, a hidden file, a link, a FIFO, long and unicode
    names, `./` before each name."""
    files = tmp_path / "files"
    (files / "d").mkdir(parents=True)
    for name, data in [("a.b.c.JPG", b"1"), ("a.b.c.cls", b"2"), ("y..b", b"3"),
                       ("d/in.txt", b"4"), ("noextension", b"5"), (".hidden.txt", b"6"),
                       ("n" * 150 + ".txt", b"7"), ("naïve-ß.txt", b"8")]:
        (files / name).write_bytes(data)
    os.symlink("d/in.txt", files / "link.txt")
    os.mkfifo(files / "pipe.txt")
    shard = tmp_path / "odd.tar"
    gnu_tar(files, shard, ["."], "--format=pax", "--sort=name")
    return shard


def gzipped(tmp_path: Path) -> Path:
    """A gzip-compressed shard, as WebDataset's `sample.tgz`: read by WebDataset whole."""
    shard = tmp_path / "shard.tar.gz"
    shard.write_bytes(gzip.compress(written_bytes(
        [(f"s{n:02d}.{ext}", b"%s%d" % (ext.encode(), n)) for n in range(12)
         for ext in ("jpg", "cls")])))
    return shard


SHARDS: dict[str, Callable[[Path], Path]] = {
    "sparse, pax format 1.0 (GNU tar --sparse --format=pax)": sparse_shard("--format=pax"),
    "sparse, pax format 0.1": sparse_shard("--format=pax", "--sparse-version=0.1"),
    "sparse, pax format 0.0": sparse_shard("--format=pax", "--sparse-version=0.0"),
    "sparse, old GNU (type S, extension blocks)": sparse_shard("--format=gnu"),
    "__meta__/ folder and __index__ file": written([
        ("__index__", b"metadata"), ("__meta__/x.txt", b"in a metadata folder"),
        ("k.txt", b"kept"), ("k.cls", b"1")]),
    "pax size over the header's": pax_size,
    "GNU tar's odd tree": odd_tree,
    "a gzip-compressed shard (.tar.gz)": gzipped,
    "GNU long names": written([("g" * 200 + ".txt", b"long"), ("h.txt", b"h")],
                              tarfile.GNU_FORMAT),
}


@pytest.mark.parametrize("case", list(SHARDS))
def test_samples_equal_webdatasets(tmp_path: Path, case: str) -> None:
    shard = SHARDS[case](tmp_path)
    theirs = webdataset_reads(shard)
    assert theirs  # the case holds samples
    assert aioloader_reads(shard) == theirs


