"""A decode process writes each sample into its row of the shared block as it comes (`Rows`),
and a pass's first chunk is decoded in parts that write into one block: both give what one
`default_collate` of the samples gives, values and dtypes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import default_collate
from aioloader._datasets.streaming import ordered_ahead
from aioloader._ipc import shm, transport
from aioloader._ipc.messages import Chunk, ChunkResult
from aioloader._pass.budget import MemoryBudget, ReadAhead
from aioloader._worker.decode import DecodeSpec, join_rows, respond

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm (Linux)")

BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "memory_budget.py"


def rich(index: int) -> dict[str, Any]:
    """Arrays (large enough for a block), numbers, text and nesting."""
    return {"image": np.full((64, 64, 8), index, np.float32), "label": index,
            "name": f"s{index}", "pair": (np.arange(3, dtype=np.int16) + index, 0.5 * index)}


def widening(index: int) -> dict[str, Any]:
    """Sample 2 on has a wider dtype than the first: collate widens the batch."""
    dtype = np.int8 if index < 2 else np.int64
    return {"image": np.full((64, 64, 8), index, np.float32), "rows": np.full(4, index, dtype)}


def picky(index: int) -> dict[str, Any]:
    if index in (1, 6):
        raise ValueError(f"sample {index} is bad")
    return rich(index)


def expected(decode: Callable[[int], Any], indices: list[int]) -> Any:
    samples = []
    for index in indices:
        try:
            samples.append(decode(index))
        except ValueError:
            continue
    return default_collate(samples)


def same(ours: Any, theirs: Any) -> None:
    if isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype
        assert np.array_equal(ours, theirs)
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            same(ours[key], theirs[key])
    elif isinstance(theirs, (tuple, list)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs)
        for mine, other in zip(ours, theirs, strict=True):
            same(mine, other)
    else:
        assert ours == theirs


def mapped(result: ChunkResult, slot: transport.Slot) -> Any:
    """The result's batch, its places mapped out of the block."""
    assert result.failure is None, result.failure
    if not result.shared:
        return result.items[0]
    block = shm.attach_block(slot.name)
    return transport.views(block, result.items, lambda: None)[0]


@pytest.fixture
def fresh_name() -> Any:
    name, descriptor = shm.new_block()
    yield name
    os.close(descriptor)


@pytest.mark.parametrize("decode", [rich, widening])
def test_rows_written_as_samples_come_give_one_collate(decode: Callable[[int], Any],
                                                      fresh_name: str) -> None:
    spec = DecodeSpec(decode, default_collate, skip_errors=False, seed=0)
    slot = transport.Slot(fresh_name, 0)
    result = respond(spec, Chunk(0, list(range(5)), list(range(5)), slot))
    same(mapped(result, slot), expected(decode, list(range(5))))  # widened: as a list


def test_parts_of_a_first_chunk_write_their_rows_into_the_first_parts_block(
        fresh_name: str) -> None:
    spec = DecodeSpec(picky, default_collate, skip_errors=True, seed=0)
    indices = list(range(8))
    slot = transport.Slot(fresh_name, 0)
    first = respond(spec, Chunk(0, indices[:1], indices[:1], slot, rows=8))
    assert first.shared and first.layout is not None
    lent = transport.Slot(fresh_name, first.needed)
    parts = [respond(spec, Chunk(0, piece, piece, lent, rows=8, first_row=start,
                                 layout=first.layout))
             for start, piece in ((1, indices[1:5]), (5, indices[5:]))]
    memory = np.frombuffer(shm.attach_block(fresh_name), np.uint8)
    joined = join_rows([first, *parts], [1, 4, 3], memory)
    assert [position for position, _ in joined.skipped] == [1, 6]
    joined.shared = True
    same(mapped(joined, slot), expected(picky, indices))


class Indices(aioloader.Dataset):
    def __len__(self) -> int:
        return 16

    async def fetch(self, index: int) -> int:
        return index


def test_a_loaders_first_batch_in_parts_with_skips_is_the_inline_batch() -> None:
    options: dict[str, Any] = dict(decode=picky, batch_size=8, on_error="skip")
    ours = aioloader.Loader(Indices(), num_workers=2, **options)
    inline = aioloader.Loader(Indices(), num_workers=0, **options)
    with ours, inline:
        for mine, theirs in zip(ours, inline, strict=True):
            same(mine, theirs)


@pytest.mark.parametrize("row", [(50, 2, 128, "process", 1), (50, 2, 128, "None", 1),
                                 (100, 1, 256, "process", 1), (8, 4, 128, "node", 3)])
def test_memory_limit_bounds_shared_memory_and_every_processs_heap(
        row: tuple[int, int, int, str, int]) -> None:
    """Samples 1,000,000 times their raw size, a consumer that holds no batch while it
    sleeps: peak shared memory plus the peak heap growth of every process of the job stays
    within the limit, plus 64 MiB for the interpreters' own (`benchmarks/memory_budget.py`).
    A node's limit is the node's: three ranks, seven processes, one account."""
    size, batch, limit, service, ranks = row
    output = subprocess.run([sys.executable, str(BENCHMARK), str(size), str(batch), str(limit),
                             service, str(ranks)], capture_output=True, text=True, timeout=240)
    assert output.returncode == 0, output.stderr
    got = json.loads(output.stdout.strip().splitlines()[-1])
    assert got["total_mib"] <= limit + 64, got


async def test_a_stream_reads_ahead_within_the_memory_limits_room_and_counts_it() -> None:
    """Pieces read ahead (a stream's windows) are counted in the account until handed over,
    and only those that fit in its room are read ahead; closing early gives all of it back."""
    budget = MemoryBudget(limit=250)
    room = ReadAhead(budget)
    started: list[int] = []
    in_flight: list[int] = []

    def job(n: int) -> tuple[Callable[[], Any], int]:
        async def read() -> int:
            started.append(n)
            in_flight.append(budget.held())
            await asyncio.sleep(0)
            return n
        return read, 100

    pieces = ordered_ahead((job(n) for n in range(6)), ahead=5, room=room)
    got = [await pieces.__anext__()]
    assert started == [0, 1] and max(in_flight) <= 250  # 100 each: a third would not fit
    got.append(await pieces.__anext__())
    assert budget.held() <= 250
    await pieces.aclose()
    assert got == [0, 1] and budget.held() == 0 and room.held_here == 0
