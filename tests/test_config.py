"""The configuration is data: frozen, validated once, and the Loader a front over it."""

from __future__ import annotations

import dataclasses

import pytest

import aioloader
from aioloader._config import LoaderConfig


def test_a_setting_cannot_change_after_the_loader_is_built(urls: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), batch_size=4, num_workers=0)
    for name in ("batch_size", "drop_last", "dataset"):  # ValueError, as DataLoader's, too
        with pytest.raises(AttributeError, match="fixed") as refused:
            setattr(loader, name, None)
        assert isinstance(refused.value, ValueError)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loader.config.batch_size = None  # type: ignore[misc]
    assert loader.batch_size == loader.config.batch_size == 4
    loader.close()


def test_the_configuration_validates_itself_when_made(urls: list[str]) -> None:
    data = aioloader.Files(urls)
    with pytest.raises(ValueError, match="prefetch"):
        LoaderConfig(dataset=data, prefetch=0)
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        LoaderConfig(dataset=data, rank=2, world_size=2)
    with pytest.raises(TypeError, match="shuffle must be True or False"):
        LoaderConfig(dataset=data, shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="executor="):
        LoaderConfig(dataset=data, service="process", has_executor=True)
    with pytest.raises(ValueError, match="num_workers=0"):
        LoaderConfig(dataset=data, service="process", num_workers=0)


def test_a_loader_built_from_a_configuration_gives_the_same_batches(urls: list[str]) -> None:
    first = aioloader.Loader(aioloader.Files(urls), batch_size=3, shuffle=True, seed=4,
                             num_workers=0)
    second = aioloader.Loader.from_config(first.config)
    with first, second:
        assert list(first) == list(second)
