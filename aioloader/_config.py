"""A loader's configuration as data: one frozen value, validated once when it is made.

The Loader is a front over it (epoch, position, lifecycle, iteration); passes are built from
it, in the training process or in a loader service, where it travels by value. Being frozen, a
setting cannot change half-way: a pass, a decode spec and a service all see the same one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ._cache import SharedCache
from ._collate import default_collate
from ._datasets import Dataset, Stream
from ._datasets.torchiter import FromTorchIterable
from ._worker.decode import takes_rng
from .storage._diskcache import DEFAULT_LIMIT as DEFAULT_DISK_CACHE_LIMIT
from .storage._limits import DEFAULT_MAX_OBJECT_BYTES
from .storage._retry import DEFAULT_RETRIES, DEFAULT_TIMEOUT, RetryPolicy

DEFAULT_MEMORY_LIMIT = 1 << 30
Service = Literal["process", "node"]


@dataclass(frozen=True)
class LoaderConfig:
    """Every setting of a Loader (see `Loader` for what each means), checked in
    `__post_init__`; `rank` and `world_size` are resolved, `concurrency` is a number (the
    starting point when `auto_concurrency`)."""

    dataset: Dataset | Stream
    decode: Callable[..., Any] | None = None
    batch_size: int | None = 64
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    concurrency: int = 64
    auto_concurrency: bool = False
    num_workers: int = 2
    prefetch: int = 4
    ordered: bool = True
    collate: Callable[[list[Any]], Any] = default_collate
    worker_init: Callable[[int], Any] | None = None
    rank: int = 0
    world_size: int = 1
    on_error: Literal["raise", "skip"] = "raise"
    persistent_workers: bool = False
    retries: int = DEFAULT_RETRIES
    timeout: float = DEFAULT_TIMEOUT
    shared_memory: bool = True
    augment: Callable[..., Any] | None = None
    cache: SharedCache | None = None
    cache_dir: str | None = None
    cache_limit: int = DEFAULT_DISK_CACHE_LIMIT
    decode_timeout: float | None = None
    stall_timeout: float = 600.0
    max_worker_restarts: int = 3
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES
    hedge: bool = True
    service: Service | None = None
    """Where passes run: None in the caller's process, "process" in a loader process of its
    own, "node" in one loader process shared by every rank of the node."""
    has_executor: bool = field(default=False, compare=False)
    """Decoding goes to an executor the caller owns, which stays in the caller's process."""

    def __post_init__(self) -> None:
        dataset = self.dataset
        if not isinstance(dataset, (Dataset, Stream)):
            raise TypeError(
                "dataset must be an aioloader.Dataset (subclass it: __len__ and async "
                "fetch(index)) or an aioloader.Stream (async __aiter__), got "
                f"{type(dataset).__name__}"
            )
        check_count("batch_size", self.batch_size, minimum=1, allow_none=True)
        for name in ("concurrency", "prefetch", "world_size", "memory_limit", "max_object_bytes"):
            check_count(name, getattr(self, name), minimum=1)
        for name in ("num_workers", "seed", "max_worker_restarts"):
            check_count(name, getattr(self, name), minimum=0)
        for name in ("shuffle", "drop_last", "ordered", "persistent_workers", "shared_memory",
                     "hedge"):
            flag = getattr(self, name)
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
            object.__setattr__(self, name, bool(flag))
        check_seconds("decode_timeout", self.decode_timeout, allow_none=True)
        check_seconds("stall_timeout", self.stall_timeout)
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f'on_error must be "raise" or "skip", got {self.on_error!r}')
        if self.decode is not None and not callable(self.decode):
            raise TypeError(f"decode must be a function or None, got {self.decode!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or not (
                0 <= self.rank < self.world_size):
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank}")
        RetryPolicy(self.retries, self.timeout)  # validates both
        if isinstance(dataset, FromTorchIterable):
            self._check_iterable()
        if isinstance(dataset, Stream):
            dataset.check_batching(self.batch_size, self.ordered)
        else:
            dataset.check_world_size(self.world_size)
        if self.has_executor and self.worker_init is not None:
            raise ValueError("worker_init runs in the built-in decode processes; with executor=, "
                             "set up the executor's workers yourself")
        if self.cache is not None:
            if isinstance(dataset, Stream):
                raise ValueError("cache= needs map-style data: a stream has no stable index")
            if takes_rng(self.decode):
                raise ValueError("decode= feeds the cache, so it must not be random: move the "
                                 "random part into augment=(value, rng)")
        self._check_service()

    def _check_iterable(self) -> None:
        """An IterableDataset orders and divides itself, in the decode processes of its own
        rank, as with DataLoader."""
        if self.shuffle:
            raise ValueError("an IterableDataset orders its items itself: shuffle=True does not "
                             "apply (DataLoader refuses it too); shuffle inside the dataset")
        if self.service == "node" or self.has_executor:
            raise ValueError("an IterableDataset is iterated in its own rank's decode "
                             "processes: use service='process' or None, without executor=")

    def _check_service(self) -> None:
        if self.service not in (None, "process", "node"):
            raise ValueError(f'service must be "process", "node" or None, got {self.service!r}')
        if self.service is None:
            return
        if self.has_executor:
            raise ValueError(f'service="{self.service}" decodes in its own processes; with '
                             "executor=, use service=None")
        if not self.num_workers:
            raise ValueError(f'service="{self.service}" needs decode processes: num_workers=0 '
                             "decodes in the caller's thread (use service=None)")

    @property
    def skip_errors(self) -> bool:
        return self.on_error == "skip"


def default_service(num_workers: int, has_executor: bool) -> Service | None:
    """A loader process of its own whenever there are decode processes to run; otherwise the
    caller's thread, so pdb stops in fetch and decode."""
    return "process" if num_workers and not has_executor and os.name == "posix" else None


def check_count(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_seconds(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 < value < math.inf
    ):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
