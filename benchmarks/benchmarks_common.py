"""Baselines shared by the benchmarks; importable by DataLoader worker processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import requests
import torch.utils.data


class RequestsDataset(torch.utils.data.Dataset[Any]):
    """What a PyTorch user writes for remote data: one blocking GET per __getitem__."""

    def __init__(self, urls: list[str], decode: Callable[[bytes], Any]) -> None:
        self.urls = urls
        self.decode = decode
        self._session: requests.Session | None = None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> Any:
        if self._session is None:  # one keep-alive session per worker process
            self._session = requests.Session()
        response = self._session.get(self.urls[index], timeout=30)
        response.raise_for_status()
        return self.decode(response.content)
