"""Shared memory the decode processes keep mapped: within the loader's memory_limit, also
after the main process has let go of the blocks (a mapping keeps a block's RAM)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from segments import mapped

import aioloader
from aioloader._ipc import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm (Linux)")

SAMPLE_BYTES = 40 * 2**20
LIMIT = 64 * 2**20


class Indices(aioloader.Dataset):
    def __len__(self) -> int:
        return 10

    async def fetch(self, index: int) -> int:
        return index


def big_sample(index: int) -> dict[str, Any]:
    """40 MiB filled with the index, and which process made it."""
    return {"pixels": np.full(SAMPLE_BYTES, index % 251, np.uint8), "pid": os.getpid()}


def test_decode_processes_keep_no_unlinked_blocks_mapped_past_the_memory_limit() -> None:
    loader = aioloader.Loader(Indices(), decode=big_sample, batch_size=1, num_workers=2,
                              memory_limit=LIMIT, persistent_workers=True)
    pids: set[int] = set()
    worst = 0
    with loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                assert (batch["pixels"] == int(batch["pixels"][0, 0])).all()
                pids.update(int(pid) for pid in batch["pid"])
                worst = max(worst, sum(mapped(pids).values()))
        assert loader.stats.transport["shared"] > 0
    one_block = SAMPLE_BYTES + 2**16  # the sample, its pid, alignment and the last page
    assert worst <= LIMIT + one_block, f"decode processes mapped {worst / 2**20:.0f} MiB"
