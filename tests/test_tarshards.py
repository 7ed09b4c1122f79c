"""WebDataset tar shards written by Python's tarfile, read from disk, nginx and the test server."""

from __future__ import annotations

import asyncio
import io
import json
import re
import tarfile
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader._datasets.indexed import _runs
from aioloader._datasets.tarshards import INDEX_SUFFIX, expand_braces, index_document
from aioloader._tar import TarFormatError, samples, tar_members
from aioloader.testing import Nginx, TestServer


def write_shard(path: Path, files: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, shards: int = 4, per_shard: int = 10) -> list[str]:
    names = []
    for s in range(shards):
        files = []
        for i in range(s * per_shard, (s + 1) * per_shard):
            files += [(f"train/{i:05d}.jpg", b"jpeg%d" % i), (f"train/{i:05d}.cls", b"%d" % i)]
        names.append(f"shard-{s:03d}.tar")
        write_shard(folder / names[-1], files)
    return names


def member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE, size: int | None = None) -> bytes:
    """One header block (GNU format: any size, even negative, fits) and the padded data."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if size is None else size
    return info.tobuf(tarfile.GNU_FORMAT) + data + bytes(-len(data) % tarfile.BLOCKSIZE)


def pax_shard(records: bytes) -> bytes:
    """A pax extended header holding `records`, then one file it would name."""
    pax = member("././@PaxHeader", records, tarfile.XHDTYPE)
    return pax + member("k.txt", b"text") + bytes(2 * tarfile.BLOCKSIZE)


def pax_record(keyword: str, value: str) -> bytes:
    """A well-formed "<length> <keyword>=<value>\\n" record."""
    body = f" {keyword}={value}\n".encode()
    digits = 1
    while len(str(len(body) + digits)) != digits:
        digits += 1
    return str(len(body) + digits).encode() + body


async def as_chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def parse(data: bytes | Iterable[bytes], where: str = "s.tar") -> list[dict[str, Any]]:
    """Samples of a shard given whole (fed in 700-byte chunks) or as its chunks."""

    async def run() -> list[dict[str, Any]]:
        chunks = as_chunks(data, 700) if isinstance(data, bytes) else _iterate(data)
        return [s async for s in samples(tar_members(chunks, where), where)]

    return asyncio.run(run())


async def _iterate(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def label(sample: dict[str, Any]) -> int:
    return int(sample["cls"])


def labels_of(loader: aioloader.Loader) -> list[int]:
    return [int(x) for batch in loader for x in batch]


def read_samples(urls: str | list[str]) -> list[dict[str, Any]]:
    return list(aioloader.Loader(aioloader.TarShards(urls), batch_size=None, num_workers=0))


def test_files_are_grouped_by_webdataset_rules(tmp_path: Path) -> None:
    long_key = "deep/" * 30 + "sample"
    write_shard(tmp_path / "a.tar", [
        ("__index__", b"metadata, skipped"),
        ("__meta__/x.txt", b"in a metadata folder: skipped, as WebDataset skips it"),
        ("x/one.JPG", b"j1"), ("x/one.seg.png", b"s1"), ("x/one.cls", b"1"),
        ("noextension", b"skipped"),
        ("x/two.jpg", b"j2"),
        (long_key + ".txt", b"long names come through pax headers"),
    ])
    samples = read_samples(str(tmp_path / "a.tar"))
    assert [s["__key__"] for s in samples] == ["x/one", "x/two", long_key]
    assert samples[0] == {
        "__key__": "x/one", "__url__": str(tmp_path / "a.tar"),
        "jpg": b"j1", "seg.png": b"s1", "cls": b"1",
    }
    assert samples[2]["txt"] == b"long names come through pax headers"


def test_repeated_extension_names_the_shard_and_key(tmp_path: Path) -> None:
    write_shard(tmp_path / "dup.tar", [("k.jpg", b"1"), ("k.JPG", b"2")])
    with pytest.raises(TarFormatError, match=r"dup\.tar: sample 'k' has more than one 'jpg' file"):
        read_samples(str(tmp_path / "dup.tar"))


def test_truncated_shard_names_the_shard(tmp_path: Path) -> None:
    write_shards(tmp_path, shards=1)
    data = (tmp_path / "shard-000.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:1300])
    with pytest.raises(TarFormatError, match=r"cut\.tar: truncated tar"):
        read_samples(str(tmp_path / "cut.tar"))


def test_brace_expansion() -> None:
    assert expand_braces("train-{000..002}.tar") == [
        "train-000.tar", "train-001.tar", "train-002.tar"
    ]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]


def test_shards_in_order_without_shuffle_decoded_in_the_pool(tmp_path: Path) -> None:
    write_shards(tmp_path)
    loader = aioloader.Loader(
        aioloader.TarShards(str(tmp_path / "shard-{000..003}.tar")), decode=label, batch_size=8
    )
    with loader:
        assert labels_of(loader) == list(range(40))


def test_same_samples_from_disk_nginx_and_test_server(nginx: Nginx, web_root: Path) -> None:
    folder = web_root / "tar-shards"
    folder.mkdir()
    names = write_shards(folder)
    local = read_samples(str(folder / "shard-{000..003}.tar"))
    over_nginx = read_samples(nginx.url + "tar-shards/shard-{000..003}.tar")
    with TestServer(folder, latency_ms=5) as server:
        over_test_server = read_samples([server.url + n for n in names])
    strip = [{k: v for k, v in s.items() if k != "__url__"} for s in local]
    for other in (over_nginx, over_test_server):
        assert [{k: v for k, v in s.items() if k != "__url__"} for s in other] == strip
    assert over_nginx[0]["__url__"] == nginx.url + "tar-shards/shard-000.tar"


def test_shuffle_is_reproducible_and_ranks_are_disjoint(tmp_path: Path) -> None:
    write_shards(tmp_path, shards=6)
    shards = aioloader.TarShards(str(tmp_path / "shard-{000..005}.tar"), shuffle_buffer=16)

    def epoch(rank: int, world_size: int, epoch: int = 0) -> list[int]:
        loader = aioloader.Loader(
            shards, decode=label, batch_size=4, shuffle=True, seed=9, num_workers=0,
            rank=rank, world_size=world_size,
        )
        loader.set_epoch(epoch)
        return labels_of(loader)

    whole = epoch(0, 1)
    assert sorted(whole) == list(range(60)) and whole != list(range(60))
    assert epoch(0, 1) == whole and epoch(0, 1, epoch=1) != whole
    shares = [epoch(r, 3) for r in range(3)]
    assert sorted(x for share in shares for x in share) == list(range(60))
    assert all(len(share) == 20 for share in shares)


class WholeFirstPiece(aioloader.TarShards):
    first_apart = False


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_pass_reads_its_first_batch_apart_and_gives_the_same_order(
    tmp_path: Path, shuffle: bool
) -> None:
    """The first batch waits for its own samples only, not for its whole shuffle window (46
    MB in the peers benchmark): they are read apart, first, and the order is unchanged."""
    names = write_shards(tmp_path, shards=2, per_shard=20)
    with TestServer(tmp_path) as server:
        urls = [server.url + name for name in names]

        def epoch(shards: aioloader.TarShards) -> tuple[list[int], int]:
            loader = aioloader.Loader(shards, decode=label, batch_size=4, shuffle=shuffle,
                                      seed=3, num_workers=0)
            before = server.stats()["requests"]
            return labels_of(loader), server.stats()["requests"] - before

        apart, requests = epoch(aioloader.TarShards(urls, shuffle_buffer=40))
        whole, whole_requests = epoch(WholeFirstPiece(urls, shuffle_buffer=40))
    assert apart == whole and sorted(apart) == list(range(40))
    assert whole_requests == 2  # the first piece: one read in each shard
    # and the first batch's 4 samples, a read for each run of neighbours
    assert (2 < requests <= 6) if shuffle else requests == 3


def test_runs_group_neighbouring_samples_of_one_shard_in_storage_order() -> None:
    units = np.array([1, 0, 1, 1, 0, 2])
    local = np.array([5, 3, 4, 9, 4, 4])
    assert _runs(units, local) == [[1, 4], [2, 0], [3], [5]]


@pytest.mark.parametrize("break_at", [1, 3, 7])
def test_a_pass_resumed_inside_its_first_piece_gives_the_rest_in_order(
    tmp_path: Path, break_at: int
) -> None:
    """A resumed pass reads its first batch apart too, from where it stands in the window."""
    write_shards(tmp_path, shards=2, per_shard=20)
    pattern = str(tmp_path / "shard-{000..001}.tar")

    def make(shards: aioloader.TarShards) -> aioloader.Loader:
        return aioloader.Loader(shards, decode=label, batch_size=4, shuffle=True, seed=5,
                                num_workers=0)

    whole = labels_of(make(WholeFirstPiece(pattern, shuffle_buffer=40)))
    first = make(aioloader.TarShards(pattern, shuffle_buffer=40))
    taken = []
    for batch in first:
        taken += [int(x) for x in batch]
        if len(taken) == 4 * break_at:
            state = first.state_dict()
            break
    second = make(aioloader.TarShards(pattern, shuffle_buffer=40))
    second.load_state_dict(state)
    assert taken + labels_of(second) == whole


def test_a_first_batch_read_apart_that_fails_names_the_shard(tmp_path: Path) -> None:
    """A shard cut short after it was indexed: the early reads fail with the shard's name,
    and the pieces waiting on them do not hang."""
    write_shards(tmp_path, shards=2, per_shard=20)
    shards = aioloader.TarShards(str(tmp_path / "shard-{000..001}.tar"), shuffle_buffer=40)
    for name in ("shard-000.tar", "shard-001.tar"):
        path = tmp_path / name
        path.write_bytes(path.read_bytes()[:2048])
    loader = aioloader.Loader(shards, decode=label, batch_size=4, shuffle=True, num_workers=0)
    with pytest.raises(aioloader.LoaderError, match=r"shard-00[01]\.tar"):
        labels_of(loader)


def test_fetch_errors_in_a_stream_name_the_shard(server: TestServer) -> None:
    with pytest.raises(aioloader.LoaderError, match=r"missing-shard\.tar.*404"):
        read_samples(server.url + "missing-shard.tar")


def test_pax_helpers_make_what_the_reader_accepts() -> None:
    records = pax_record("path", "dir/named.txt") + pax_record("comment", "x" * 95)
    with tarfile.open(fileobj=io.BytesIO(pax_shard(records))) as tar:
        assert tar.getnames() == ["dir/named.txt"]
    assert [s["__key__"] for s in parse(pax_shard(records))] == ["dir/named"]


@pytest.mark.timeout(20)
def test_pax_record_of_length_zero_raises_instead_of_hanging() -> None:
    with pytest.raises(TarFormatError, match=r"^s\.tar: bad pax header record at offset 512: "):
        parse(pax_shard(b"0 path=x\n"))


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "record",
    [
        b"0 path=x\n",  # length 0
        b"3 path=x\n",  # length inside its own digits
        b"x3 path=a\n",  # not a number
        b"-9 path=a\n",  # negative
        b"99 path=a\n",  # past the end of the header data
        b"12 pathxabc\n",  # no '='
        b"11 =abcdef\n",  # no keyword
        b"12 path=abcd\0",  # no newline where the length ends
        b"path=a\n",  # no length at all
        b"18446744073709551616999 path=a\n",  # absurdly many digits
    ],
)
def test_malformed_pax_records_raise_tar_format_error_naming_shard_and_offset(
    record: bytes,
) -> None:
    first = pax_record("mtime", "1.5")
    at = 512 + len(first)
    with pytest.raises(TarFormatError, match=rf"^s\.tar: bad pax header record at offset {at}: "):
        parse(pax_shard(first + record))


def test_malformed_global_pax_header_is_reported_too() -> None:
    data = member("pax_global_header", b"5 x\n\n", tarfile.XGLTYPE) + member("k.txt", b"t")
    with pytest.raises(TarFormatError, match=r"^s\.tar: bad pax header record at offset 512"):
        parse(data)


def test_pax_records_may_end_in_zero_padding_as_tarfile_accepts() -> None:
    records = pax_record("path", "padded.txt") + bytes(20)
    assert [s["__key__"] for s in parse(pax_shard(records))] == ["padded"]


def test_bad_number_in_a_header_names_the_shard_and_offset() -> None:
    second = bytearray(member("b.txt", b"b"))
    second[108:116] = b"9" * 8  # uid: not octal
    with pytest.raises(TarFormatError, match=r"^s\.tar: bad tar header at offset 1024"):
        parse(member("a.txt", b"a") + bytes(second))


def test_a_compressed_archive_where_a_range_is_read_names_its_compression() -> None:
    """A compressed shard is read whole, from its first byte (TarShards): where a range of one
    is parsed as tar, the error says what was found."""
    import bz2
    import gzip
    import os

    for shard in (member("a.txt", os.urandom(4096)), member("a.txt", b"a")):  # also < a block
        for compress, kind in ((gzip.compress, "gzip"), (bz2.compress, "bzip2")):
            with pytest.raises(TarFormatError, match=rf"^s\.tar: .* at offset 0.*"
                                                     rf"this is a {kind} stream"):
                parse(compress(shard))


def test_negative_base256_size_raises_instead_of_swallowing_the_shard() -> None:
    data = member("a.txt", b"", size=-1) + member("b.txt", b"b") + member("c.txt", b"c")
    with pytest.raises(
        TarFormatError, match=r"^s\.tar: tar member 'a.txt' at offset 0 declares a negative size"
    ):
        parse(data)


def test_forged_huge_member_size_is_refused_before_reading_it() -> None:
    pulled = []

    def chunks() -> Iterable[bytes]:
        yield member("x/forged.bin", b"", size=1 << 40)
        zeros = bytes(1 << 20)
        for n in range(16):
            pulled.append(n)
            yield zeros

    with pytest.raises(
        TarFormatError,
        match=rf"^s\.tar: tar member 'x/forged.bin' at offset 0 declares {1 << 40} bytes, "
        rf"over the limit of {2 << 30} bytes",
    ):
        parse(chunks())
    assert len(pulled) <= 1


def test_max_member_bytes_refuses_a_larger_member_and_admits_one_at_the_limit(
    tmp_path: Path,
) -> None:
    write_shard(tmp_path / "big.tar", [("a.txt", b"small"), ("b/large.bin", bytes(5000))])
    url = str(tmp_path / "big.tar")
    with pytest.raises(
        TarFormatError,
        match=r"big\.tar: tar member 'b/large.bin' at offset 1024 declares 5000 bytes, "
        r"over the limit of 4096 bytes",
    ):
        list(aioloader.Loader(
            aioloader.TarShards(url, max_member_bytes=4096), batch_size=None, num_workers=0
        ))
    loader = aioloader.Loader(
        aioloader.TarShards(url, max_member_bytes=5000), batch_size=None, num_workers=0
    )
    assert [s["__key__"] for s in loader] == ["a", "b/large"]


def test_long_names_over_a_mebibyte_are_refused() -> None:
    data = member("././@LongLink", b"", tarfile.GNUTYPE_LONGNAME, size=(1 << 20) + 1)
    with pytest.raises(TarFormatError, match=r"^s\.tar: .* over the limit of 1048576 bytes"):
        parse(data)


def index_beside(shard: Path, starts: list[int]) -> None:
    """An index beside `shard` as `aioloader pack` writes it, with the given starts."""
    Path(str(shard) + INDEX_SUFFIX).write_text(
        index_document(shard.name, starts, shard.stat().st_size))


def true_starts(shard: Path, first: str = ".jpg") -> list[int]:
    """Where each sample's first file (named `*first`) starts."""
    with tarfile.open(shard) as tar:
        return [m.offset for m in tar.getmembers() if m.name.endswith(first)]


def test_an_index_whose_starts_skip_sample_0_is_refused_naming_the_shard(
    tmp_path: Path,
) -> None:
    """Reads start at the index's first start: sample 0 before it was never read, and the
    epoch one sample short, without a word."""
    write_shards(tmp_path, shards=1)
    shard = tmp_path / "shard-000.tar"
    starts = true_starts(shard)
    index_beside(shard, starts[1:])
    with pytest.raises(
        TarFormatError,
        match=rf"shard-000\.tar\.index\.json: its first sample starts at byte {starts[1]}, "
        r"but the shard holds sample 'train/00000' at byte 0, which would never be read; "
        r"the index does not fit the shard: remove it",
    ):
        aioloader.TarShards(str(shard), index_dir=tmp_path / "kept")
    index_beside(shard, [starts[0] + 100, *starts[1:]])
    with pytest.raises(TarFormatError, match=r"sample 0 starts at byte 100, where no tar "):
        aioloader.TarShards(str(shard), index_dir=tmp_path / "kept")
    index_beside(shard, starts)
    assert len(aioloader.TarShards(str(shard), index_dir=tmp_path / "kept")) == 10


def test_files_webdataset_passes_over_may_come_before_the_first_start(tmp_path: Path) -> None:
    """The check of what lies before the first start refuses samples there, not metadata."""
    write_shard(tmp_path / "meta.tar", [("__index__", b"x" * 700), ("a.txt", b"a"),
                                        ("b.txt", b"b")])
    shard = tmp_path / "meta.tar"
    starts = true_starts(shard, ".txt")
    assert starts[0] > 0
    index_beside(shard, starts)
    assert [s["__key__"] for s in read_samples(str(shard))] == ["a", "b"]


def test_a_kept_index_that_skips_samples_is_made_again_by_reading_the_shard(
    tmp_path: Path,
) -> None:
    """An index in the index folder is aioloader's own cache: one that does not fit its shard
    (the shard rewritten at the same size) is replaced, not an error."""
    write_shards(tmp_path, shards=1)
    shard = tmp_path / "shard-000.tar"
    kept = tmp_path / "kept"
    assert len(aioloader.TarShards(str(shard), index_dir=kept)) == 10
    [document] = kept.glob("*.json")
    document.write_text(index_document(str(shard), true_starts(shard)[3:],
                                       shard.stat().st_size))
    shards = aioloader.TarShards(str(shard), index_dir=kept)
    assert len(shards) == 10
    assert json.loads(document.read_text())["starts"] == true_starts(shard)


def test_a_pax_size_overrides_the_headers_as_for_members_over_8_gib() -> None:
    """Over 8 GiB a header's size field cannot hold the size: tar writes 0 there and the size
    in a pax header, which readers must take (as tarfile and WebDataset do)."""
    def overridden(size: str, data: bytes) -> bytes:
        return (member("././@PaxHeader", pax_record("size", size), tarfile.XHDTYPE)
                + member("k.txt", data, size=0))

    shard = overridden("4", b"text") + member("l.txt", b"next") + bytes(2 * tarfile.BLOCKSIZE)
    with tarfile.open(fileobj=io.BytesIO(shard)) as tar:
        extracted = tar.extractfile("k.txt")
        assert extracted is not None and extracted.read() == b"text"
    assert [(s["__key__"], s["txt"]) for s in parse(shard)] == [("k", b"text"), ("l", b"next")]
    with pytest.raises(TarFormatError, match=r"gives size 'x', not a number"):
        parse(overridden("x", b""))
    with pytest.raises(TarFormatError, match="over the limit"):  # before any of it is read
        parse(overridden(str(20 * 2**30), b""))


def compressed_shards(folder: Path, kind: str, shards: int, per_shard: int) -> list[str]:
    """Shards as write_shards makes them, each compressed whole (gzip: `.tar.gz`, as
    WebDataset's are)."""
    import bz2
    import gzip
    import lzma

    compress = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}[kind]
    names = write_shards(folder, shards, per_shard)
    for n, name in enumerate(names):
        plain = folder / name
        names[n] = f"{name}.{kind}"
        (folder / names[n]).write_bytes(compress(plain.read_bytes()))
        plain.unlink()
    return names


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz"])
def test_compressed_shards_divide_by_samples_and_each_is_read_once_a_pass(
        tmp_path: Path, kind: str) -> None:
    """A compressed shard cannot be read by ranges: a rank reads it from its first byte,
    once a pass, whatever the number of pieces its share is read in, and every rank still
    gets as many samples (its index counts them, once)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    names = compressed_shards(folder, kind, shards=3, per_shard=600)
    with TestServer(folder) as server:
        urls = [server.url + name for name in names]
        shards = aioloader.TarShards(urls, shuffle_buffer=100, index_dir=tmp_path / "index")
        kept = [json.loads(p.read_text()) for p in (tmp_path / "index").iterdir()]
        assert {k["compression"] for k in kept} == {kind}
        for world_size in (1, 2, 3):
            shares = []
            for rank in range(world_size):
                loader = aioloader.Loader(shards, decode=label, batch_size=10, shuffle=True,
                                          num_workers=0, rank=rank, world_size=world_size)
                before = server.stats()["requests"]
                shares.append(labels_of(loader))
                # one GET a shard, of those it reads (a rank's share ends in one, or two)
                assert server.stats()["requests"] - before <= len(names)
            assert sorted(x for share in shares for x in share) == list(range(1800))
            assert {len(share) for share in shares} == {1800 // world_size}
        again = server.stats()["requests"]
        assert aioloader.TarShards(urls, index_dir=tmp_path / "index").starts == shards.starts
        assert server.stats()["requests"] - again == 2 * len(names)  # sizes and indexes, no scan


def test_a_damaged_or_unread_compressed_shard_names_the_shard_and_what_is_wrong(
        tmp_path: Path) -> None:
    import gzip

    shard = gzip.compress(member("a.txt", b"a" * 5000) + member("b.txt", b"b"))
    cases = {
        "cut.tar.gz": (shard[:-20], "the gzip stream ends before its end"),
        "bad.tar.gz": (shard[:30] + bytes(40) + shard[70:], "the gzip stream is damaged"),
        "z.tar.zst": (b"\x28\xb5\x2f\xfd" + bytes(600),
                      "a zstd stream: only gzip, bzip2 and xz are read"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TarFormatError, match=rf"{re.escape(name)}: {message}"):
            aioloader.TarShards(str(tmp_path / name), index_dir=tmp_path / "index")


def test_a_gnu_sparse_header_with_a_bad_number_names_the_shard_and_offset(
        tmp_path: Path) -> None:
    """A type S member whose extension block (the pieces past the header's four) holds a
    field that is not a number: a TarFormatError, not a ValueError from inside the reader.
    (A bad number in the header itself is refused by its own parse, as any header's.)"""
    import subprocess

    with open(tmp_path / "sp.bin", "wb") as file:
        for piece in range(10):
            file.seek(piece * 20_000)
            file.write(b"x" * 1000)
        file.truncate(300_000)
    subprocess.run(["tar", "-C", str(tmp_path), "--sparse", "--format=gnu", "-cf",
                    str(tmp_path / "s.tar"), "sp.bin"], check=True)
    shard = bytearray((tmp_path / "s.tar").read_bytes())
    assert shard[156:157] == tarfile.GNUTYPE_SPARSE and shard[482] == 1  # more pieces follow
    assert [s["bin"].count(b"x") for s in parse(bytes(shard))] == [10_000]
    shard[512:524] = b"9" * 12  # the fifth piece's offset, in the extension block: not octal
    with pytest.raises(TarFormatError, match=r"^s\.tar: bad sparse header at offset 0"):
        parse(bytes(shard))
