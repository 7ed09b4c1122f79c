"""A pass is built from data: the factory the Loader and both services call, tried here with
no process at all (decoding inline, a dataset in memory)."""

from __future__ import annotations

from typing import Any

import aioloader
from aioloader._config import LoaderConfig
from aioloader._pass.factory import PassFactory
from aioloader._pass.pipeline import END


class Numbers(aioloader.Dataset):
    def __len__(self) -> int:
        return 10

    async def fetch(self, index: int) -> int:
        return index


async def _batches(factory: PassFactory, epoch: int, start: int) -> list[list[Any]]:
    running = await factory.open(epoch, start, None)
    got = []
    try:
        while (item := await running.next()) is not END:
            got.append([int(i) for i in item])
    finally:
        await running.aclose()
    return got


async def test_a_factory_builds_a_pass_from_a_configuration_and_a_position() -> None:
    factory = PassFactory(LoaderConfig(dataset=Numbers(), batch_size=4, num_workers=0))
    try:
        assert await _batches(factory, 0, 0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert await _batches(factory, 0, 4) == [[4, 5, 6, 7], [8, 9]]
        assert factory.stats.samples == 16, "one stats object across its passes"
    finally:
        factory.close()


async def test_a_factorys_pass_is_the_loaders_for_the_same_epoch_and_rank() -> None:
    config = LoaderConfig(dataset=Numbers(), batch_size=2, num_workers=0, shuffle=True,
                          seed=7, rank=1, world_size=2)
    factory = PassFactory(config)
    try:
        built = await _batches(factory, 3, 0)
    finally:
        factory.close()
    loader = aioloader.Loader.from_config(config)
    loader.set_epoch(3)
    async with loader:
        assert built == [[int(i) for i in batch] async for batch in loader]
