"""Pieces shared by the benchmarks; importable by DataLoader worker processes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import requests
from tqdm import tqdm

import aioloader

PR_SET_CHILD_SUBREAPER = 36
REAP_SECONDS = 30.0


class Indices(aioloader.Dataset):
    """`count` samples, each its index: the decode makes the sample (or nothing does)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    async def fetch(self, index: int) -> int:
        return index


class RequestsDataset:
    """What a PyTorch user writes for remote data: a map-style dataset, one GET per item."""

    def __init__(self, urls: list[str], decode: Callable[[bytes], Any]) -> None:
        self.urls = urls
        self.decode = decode
        self._session: requests.Session | None = None
        self._session_pid = 0

    def __len__(self) -> int:
        return len(self.urls)

    def session(self) -> requests.Session:
        """One keep-alive session per process: a forked worker must not share its parent's
        sockets."""
        if self._session is None or self._session_pid != os.getpid():
            self._session, self._session_pid = requests.Session(), os.getpid()
        return self._session

    def __getitem__(self, index: int) -> Any:
        response = self.session().get(self.urls[index], timeout=30)
        response.raise_for_status()
        return self.decode(response.content)


def samples_per_second(batches: Iterable[Any], expected: int, description: str) -> float:
    """Drain `batches` with a progress bar; check that `expected` samples came."""
    seen = 0
    with tqdm(total=expected, desc=description, leave=False) as progress:
        started = time.perf_counter()
        for batch in batches:
            size = batch_length(batch)
            seen += size
            progress.update(size)
        elapsed = time.perf_counter() - started
    if seen != expected:
        raise RuntimeError(f"{description}: got {seen} samples, expected {expected}")
    return seen / elapsed


class LocalImages:
    """A map-style dataset for PyTorch: (file bytes, label) through `transform`."""

    def __init__(self, paths: list[str], labels: list[int], transform: Callable[..., Any]) -> None:
        self.paths, self.labels, self.transform = paths, labels, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Any:
        with open(self.paths[index], "rb") as file:
            raw = file.read()
        return self.transform((raw, self.labels[index]), np.random.default_rng([0, 0, index]))


class RemoteImages(RequestsDataset):
    """(downloaded bytes, label) through `transform`, one blocking GET per item."""

    def __init__(self, urls: list[str], labels: list[int], transform: Callable[..., Any]) -> None:
        super().__init__(urls, lambda raw: raw)
        self.labels, self.transform = labels, transform

    def __getitem__(self, index: int) -> Any:
        raw = super().__getitem__(index)
        return self.transform((raw, self.labels[index]), np.random.default_rng([0, 0, index]))


def batch_length(batch: Any) -> int:
    """Samples in a batch: of dicts or (images, labels) pairs (aioloader, DataLoader), or an
    array."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return len(batch[0])
    return len(batch)


# ---- runs of many processes (torchrun launches) ----


def become_subreaper() -> None:
    """Orphans of our descendants (the node service, detached by the rank that starts it, and
    its zygote) are re-parented here, so their CPU reaches RUSAGE_CHILDREN once reaped."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def children(keep: set[int]) -> list[int]:
    """Our child processes, running or zombie, but those in `keep`."""
    line = f"\nPPid:\t{os.getpid()}\n"
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in keep:
            with contextlib.suppress(OSError):
                if line in Path(f"/proc/{entry}/status").read_text():
                    found.append(int(entry))
    return found


def reap_strays(keep: set[int]) -> int:
    """Reap what a run left (re-parented here) as it ends; after REAP_SECONDS, kill it.
    Returns how many processes had to be killed."""
    deadline = time.monotonic() + REAP_SECONDS
    killed: set[int] = set()
    while strays := children(keep):
        late = time.monotonic() > deadline
        if time.monotonic() > deadline + REAP_SECONDS:
            raise RuntimeError(f"processes {strays} survive SIGKILL")
        for pid in strays:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == 0 and late:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        time.sleep(0.05)
    return len(killed)
