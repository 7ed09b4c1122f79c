"""Batches through shared memory: right values, never overwritten while held, no block held
once the loader is closed."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
from segments import blocks

import aioloader
from aioloader._ipc import shm

from decoders import SAMPLE_COUNT, big_image, die_on_five, slow_big_image

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm (Linux)")


def segments() -> set[int]:
    """The blocks of every process, held or mapped."""
    return set(blocks())


def made_since(before: set[int]) -> set[int]:
    """Blocks made since `before` and still there (an earlier test's may go meanwhile)."""
    return segments() - before


def segments_settle(before: set[int]) -> set[int]:
    """The segments made since `before` left once collection has run, waiting up to the
    contract's 5 s."""
    deadline = time.monotonic() + 5
    while (left := made_since(before)) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return left


def test_large_batches_come_through_shared_memory_unchanged(urls: list[str]) -> None:
    before = segments()
    with aioloader.Loader(aioloader.Files(urls), decode=big_image, batch_size=10) as loader:
        batches = list(loader)
        assert loader.stats.transport["shared"] > 0
        assert segments() - before
    for n, batch in enumerate(batches):
        assert batch.shape == (10, 3, 64, 64)
        assert (batch[:, 0, 0, 0] == np.arange(n * 10, n * 10 + 10)).all()
    assert batches[0][3].sum() == 3 * 64 * 64 * 3  # readable after close
    del batches, batch
    assert not segments_settle(before)  # the pool let go at close: the views held the rest


@pytest.mark.parametrize("service", [None, "process"])
def test_a_first_batch_joined_from_parts_comes_in_one_block_and_its_parts_go(
    local_paths: list[str], service: str | None
) -> None:
    """Each pass's first batch is decoded in parts by both processes and joined into one
    block; the parts' blocks, sized for a part, are removed, never lent for a whole batch."""
    before = segments()
    loader = aioloader.Loader(aioloader.Files(local_paths[:40]), decode=big_image,
                              batch_size=10, num_workers=2, persistent_workers=True,
                              service=service)
    with loader:
        for _ in range(3):
            batches = list(loader)
            assert [int(i) for b in batches for i in b[:, 0, 0, 0]] == list(range(40))
        assert loader.stats.transport == {"shared": 12, "pickled": 0}
        if service is None:
            assert loader._factory.blocks is not None
            assert loader._factory.blocks.segments <= loader._factory.blocks.max_blocks
        del batches
    assert not segments_settle(before)


@pytest.mark.parametrize("service", [None, "process"])
def test_a_chunk_waiting_for_a_process_holds_no_block(
    local_paths: list[str], service: str | None
) -> None:
    """Decode-bound, chunks wait for the process: a block is lent as a chunk goes to it, so
    the blocks the consumer let go of are used again. Lent while waiting, every chunk of
    the decode window made a block of its own (9-10 here, 4-5 now)."""
    before = segments()
    made: set[int] = set()
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=slow_big_image,
                              batch_size=10, num_workers=1, service=service)
    with loader:
        for _ in loader:
            made |= segments() - before
    assert len(made) <= 6


def mixed_widths(raw: bytes) -> dict[str, object]:
    """Parts of one batch get different dtypes: strings of 1 and 60 characters, int32 and
    Python ints, so the joined batch is wider than its parts together."""
    index = int.from_bytes(raw[:4], "little")
    return {"image": np.full((3, 64, 64), index, np.float32),
            "name": np.str_("n" if index < 4 else "n" * 60),
            "count": np.int32(index) if index < 4 else index,
            "rows": np.array([[index]], dtype=np.int8 if index < 4 else np.int64)}


def test_a_first_batch_whose_parts_differ_in_dtype_joins_as_one_collate_would(
    local_paths: list[str]
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths[:16]), decode=mixed_widths,
                              batch_size=8, num_workers=2)
    inline = aioloader.Loader(aioloader.Files(local_paths[:16]), decode=mixed_widths,
                              batch_size=8, num_workers=0)
    with loader:
        for ours, theirs in zip(loader, inline, strict=True):
            for key in theirs:
                assert np.asarray(ours[key]).dtype == np.asarray(theirs[key]).dtype, key
                assert np.array_equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("service", [None, "process"])
def test_kept_batches_never_change_while_blocks_are_reused(
    urls: list[str], service: str | None
) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=big_image, batch_size=4,
                              prefetch=1, concurrency=4, service=service)
    kept_one = None
    with loader:
        kept_all = list(loader)  # holds every block: more are lent, none pickled
        assert loader.stats.transport == {"shared": len(kept_all), "pickled": 0}
        indices = [int(i) for batch in kept_all for i in batch[:, 0, 0, 0]]
        assert indices == list(range(SAMPLE_COUNT))
        del kept_all
        for batch in loader:
            kept_one = batch  # holds one at a time: blocks are reused
        if service is None:  # those lent past the pool's size went with their batches
            assert loader._factory.blocks is not None
            assert loader._factory.blocks.segments <= loader._factory.blocks.max_blocks
    assert kept_one is not None and int(kept_one[-1, 0, 0, 0]) == SAMPLE_COUNT - 1


def test_break_consumer_error_and_killed_worker_leave_no_segments(urls: list[str]) -> None:
    before = segments()
    loader = aioloader.Loader(aioloader.Files(urls), decode=big_image, batch_size=4)
    for n, _ in enumerate(loader):
        if n == 3:
            break
    del loader, _  # the last batch's view too: it keeps its block's memory
    assert not segments_settle(before)
    with pytest.raises(KeyError), aioloader.Loader(
        aioloader.Files(urls), decode=big_image, batch_size=4
    ) as loader:
        for _ in loader:
            raise KeyError("consumer bug")
    del _
    assert not segments_settle(before)
    with pytest.raises(aioloader.WorkerDiedError), aioloader.Loader(
        aioloader.Files(urls), decode=die_on_five, batch_size=4
    ) as loader:
        list(loader)
    assert not segments_settle(before)


def test_batches_kept_past_the_memory_limit_stay_shared_and_the_verdict_names_the_limit(
    local_paths: list[str]
) -> None:
    """Kept batches count against memory_limit wherever they are: the loader then waits for
    room, says so, and still hands every batch over in shared memory, none pickled."""
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=big_image, batch_size=4,
                              memory_limit=4 * 4 * 48 * 1024, num_workers=2, service=None)
    kept = []
    for batch in loader:
        kept.append(batch)
        time.sleep(0.02)  # the consumer's step
    assert [int(i) for batch in kept for i in batch[:, 0, 0, 0]] == list(range(SAMPLE_COUNT))
    stats = loader.stats
    assert stats.transport == {"shared": len(kept), "pickled": 0}
    assert stats.verdict().startswith("bound by memory_limit: reading or decoding waited")
    assert "came back pickled" not in stats.verdict()
