"""Pieces shared by the benchmarks; importable by DataLoader worker processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sized
from typing import Any

import requests
from tqdm import tqdm


class RequestsDataset:
    """What a PyTorch user writes for remote data: a map-style dataset, one GET per item."""

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


def samples_per_second(batches: Iterable[Sized], expected: int, description: str) -> float:
    """Drain `batches` with a progress bar; check that `expected` samples came."""
    seen = 0
    with tqdm(total=expected, desc=description, leave=False) as progress:
        started = time.perf_counter()
        for batch in batches:
            seen += len(batch)
            progress.update(len(batch))
        elapsed = time.perf_counter() - started
    if seen != expected:
        raise RuntimeError(f"{description}: got {seen} samples, expected {expected}")
    return seen / elapsed
