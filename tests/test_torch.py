"""The PyTorch bridge."""

from __future__ import annotations

import numpy as np
import pytest

import aioloader

from decoders import SAMPLE_COUNT, index_and_noise

torch = pytest.importorskip("torch")
from aioloader.torch import TorchLoader, as_iterable_dataset  # noqa: E402


def make_loader(urls: list[str]) -> aioloader.Loader:
    return aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=10)


def test_torch_loader_gives_tensors_in_the_same_structure(urls: list[str]) -> None:
    with TorchLoader(make_loader(urls)) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) == 10
    assert all(torch.is_tensor(b["index"]) and b["noise"].dtype == torch.float32 for b in batches)
    assert torch.cat([b["index"] for b in batches]).tolist() == list(range(SAMPLE_COUNT))


def test_iterable_dataset_works_inside_a_dataloader(urls: list[str]) -> None:
    reference = [b["noise"].numpy() for b in TorchLoader(make_loader(urls))]
    dataset = as_iterable_dataset(make_loader(urls))
    got = [b["noise"].numpy() for b in torch.utils.data.DataLoader(dataset, batch_size=None)]
    assert len(got) == len(reference)
    for a, b in zip(got, reference, strict=True):
        np.testing.assert_array_equal(a, b)


def test_pin_memory_without_accelerator_warns(urls: list[str]) -> None:
    with pytest.warns(UserWarning, match="no accelerator"):
        TorchLoader(make_loader(urls), pin_memory=True)
