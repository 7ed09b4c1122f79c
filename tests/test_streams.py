"""Streaming data: user streams, StreamBatches for sequence models, resuming streams."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

import aioloader
from aioloader.testing import TestServer

from decoders import as_array, plus_noise


class Counting(aioloader.Stream):
    """Items 0..n-1, rank r taking every world_size-th: a stream that shards itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> AsyncIterator[int]:
        info = aioloader.get_shard_info()
        for item in range(info.rank, self.n, info.world_size):
            yield item


def items(loader: aioloader.Loader) -> list[int]:
    return [int(i) for batch in loader for i in batch[0]]


def test_stream_items_are_decoded_once_each_in_the_pool() -> None:
    with aioloader.Loader(Counting(100), decode=plus_noise, batch_size=8, num_workers=2) as loader:
        assert items(loader) == list(range(100))


def test_ranks_read_disjoint_shares_of_a_factory_stream() -> None:
    async def numbers() -> AsyncIterator[int]:
        info = aioloader.get_shard_info()
        for item in range(info.rank, 50, info.world_size):
            yield item

    stream = aioloader.Stream.from_factory(numbers)
    shares = [
        items(aioloader.Loader(stream, decode=plus_noise, batch_size=4, num_workers=0,
                               rank=r, world_size=3))
        for r in range(3)
    ]
    assert sorted(i for share in shares for i in share) == list(range(50))


def write_files(folder: Path, sizes: list[int]) -> bytes:
    whole = b""
    for n, size in enumerate(sizes):
        data = np.random.default_rng(n).integers(0, 256, size, dtype=np.uint8).tobytes()
        (folder / f"part-{n}.bin").write_bytes(data)
        whole += data
    return whole


@pytest.mark.parametrize("batch_size", [1, 3, 7])
@pytest.mark.parametrize("sizes", [[1000], [300, 77], [50, 400, 3, 220, 128]])
def test_each_position_continues_its_own_stream(
    tmp_path: Path, batch_size: int, sizes: list[int]
) -> None:
    whole = write_files(tmp_path, sizes)
    urls = [str(tmp_path / f"part-{n}.bin") for n in range(len(sizes))]
    stream = aioloader.StreamBatches(urls, batch_size=batch_size, chunk_bytes=16)
    loader = aioloader.Loader(stream, decode=as_array, batch_size=batch_size)
    with loader:
        batches = list(loader)
    segment = len(whole) // batch_size
    assert len(batches) == len(loader) == segment // 16
    for j in range(batch_size):
        read = b"".join(batch[j].tobytes() for batch in batches)
        assert read == whole[j * segment : j * segment + len(read)]  # contiguous, crossing files


def test_positions_of_a_batch_are_read_in_parallel(tmp_path: Path) -> None:
    write_files(tmp_path, [4000, 4000])
    with TestServer(tmp_path, latency_ms=30) as server:
        stream = aioloader.StreamBatches(
            [server.url + "part-0.bin", server.url + "part-1.bin"], batch_size=8,
            chunk_bytes=100, steps_ahead=1,
        )
        list(aioloader.Loader(stream, batch_size=8, num_workers=0))
        assert server.stats()["max_in_flight"] >= 8


def test_file_order_is_shuffled_per_epoch_with_the_seed(tmp_path: Path) -> None:
    write_files(tmp_path, [64] * 6)
    urls = [str(tmp_path / f"part-{n}.bin") for n in range(6)]

    def first_batch(epoch: int) -> bytes:
        loader = aioloader.Loader(aioloader.StreamBatches(urls, 2, 8), decode=as_array,
                                  batch_size=2, shuffle=True, seed=4, num_workers=0)
        loader.set_epoch(epoch)
        return bytes(next(iter(loader)).tobytes())

    assert first_batch(0) == first_batch(0) != first_batch(1)


def test_stream_batches_refuse_other_batch_sizes(tmp_path: Path) -> None:
    write_files(tmp_path, [64])
    with pytest.raises(ValueError, match="needs Loader\\(batch_size=4, ordered=True\\)"):
        aioloader.Loader(aioloader.StreamBatches(str(tmp_path / "part-0.bin"), 4, 8), batch_size=8)


def write_tar_shards(folder: Path) -> str:
    for s in range(5):
        with tarfile.open(folder / f"s-{s}.tar", "w") as tar:
            for i in range(s * 9, s * 9 + 9):
                info = tarfile.TarInfo(f"{i:04d}.cls")
                info.size = len(str(i))
                tar.addfile(info, io.BytesIO(str(i).encode()))
    return str(folder / "s-{0..4}.tar")


def cls_of(sample: dict[str, bytes]) -> int:
    return int(sample["cls"])


@pytest.mark.parametrize("kind", ["tar", "stream batches", "user stream"])
def test_streams_resume_with_exactly_the_remaining_batches(tmp_path: Path, kind: str) -> None:
    if kind == "tar":
        stream: aioloader.Stream = aioloader.TarShards(write_tar_shards(tmp_path), shuffle_buffer=7)
        decode, batch = cls_of, 4
    elif kind == "stream batches":
        write_files(tmp_path, [500, 300])
        stream = aioloader.StreamBatches(
            [str(tmp_path / "part-0.bin"), str(tmp_path / "part-1.bin")], 3, 10)
        decode, batch = as_array, 3
    else:
        stream, decode, batch = Counting(45), plus_noise, 4

    def make() -> aioloader.Loader:
        return aioloader.Loader(stream, decode=decode, batch_size=batch, shuffle=True, seed=2,
                                num_workers=1)

    def flat(batch: object) -> str:
        return repr(np.asarray(batch[0] if isinstance(batch, tuple) else batch).tolist())

    with make() as loader:
        uninterrupted = [flat(b) for b in loader]
    with make() as first:
        taken = []
        for b in first:
            taken.append(flat(b))
            if len(taken) == 3:
                state = json.loads(json.dumps(first.state_dict()))
                break
    with make() as second:
        second.load_state_dict(state)
        assert taken + [flat(b) for b in second] == uninterrupted


def test_a_stream_resumes_only_with_the_same_world_size() -> None:
    saved = aioloader.Loader(Counting(10), rank=0, world_size=2, num_workers=0).state_dict()
    with pytest.raises(aioloader.LoaderError, match="same world size"):
        aioloader.Loader(Counting(10), num_workers=0, world_size=1, rank=0).load_state_dict(saved)
