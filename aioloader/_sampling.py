"""The index order of an epoch, and which part of it each rank takes at each step.

The global order depends only on (length, shuffle, seed, epoch). Ranks move through it in
lockstep: at step k they together take the next `world_size * step_size` samples, rank r the
r-th share. A position in the global order therefore resumes any rank, at any world size.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

Indices = npt.NDArray[np.int64]
T = TypeVar("T")
_ORDER_STREAM = 1
"""Spawn key that keeps the order's random stream apart from the per-sample streams."""


def epoch_order(
    length: int, shuffle: bool, seed: int, epoch: int, stream: int = _ORDER_STREAM
) -> Indices:
    """0..length-1, permuted with (seed, epoch) when shuffling; `stream` keeps the orders of
    different things (samples, shards, files) independent."""
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    sequence = np.random.SeedSequence([seed, epoch], spawn_key=(stream,))
    return np.random.default_rng(sequence).permutation(length).astype(np.int64)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator handed to decode for one sample: the same wherever it is decoded."""
    return np.random.default_rng([seed, epoch, index])


def steps_in_epoch(length: int, step_size: int, world_size: int, drop_last: bool) -> int:
    """How many steps an epoch of `length` samples has, without building its order."""
    group = step_size * world_size
    if drop_last:
        return length // group
    padded = -(-length // world_size) * world_size
    return -(-padded // group)


class EpochPlan:
    """The steps of one epoch for one rank, from a global position onwards; computed lazily.

    What remains after `start` is padded (or, with drop_last, cut) for this world size, so a
    job resumed on another number of ranks still gives every rank a share of equal length.
    """

    def __init__(
        self,
        order: Indices,
        step_size: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        start: int = 0,
    ) -> None:
        group = step_size * world_size
        remaining = order[start:]
        if drop_last:
            remaining = remaining[: len(remaining) // group * group]
        elif len(remaining) % world_size:  # pad with the epoch's first samples, as torch does
            wrap = world_size - len(remaining) % world_size
            remaining = np.concatenate([remaining, np.resize(order, wrap)])
        self._order = remaining
        self.start = start
        self._step_size = step_size
        self._rank = rank
        self._world_size = world_size

    def __len__(self) -> int:
        return -(-len(self._order) // (self._step_size * self._world_size))

    def step(self, k: int) -> Indices:
        """The indices this rank takes at step k (counted from `start`)."""
        group = self._step_size * self._world_size
        chunk = self._order[k * group : (k + 1) * group]
        share = len(chunk) // self._world_size
        return chunk[self._rank * share : (self._rank + 1) * share]

    def global_position(self, steps_done: int) -> int:
        """Where the global order stands after `steps_done` steps of every rank."""
        group = self._step_size * self._world_size
        return self.start + min(steps_done * group, len(self._order))


def default_rank_and_world_size() -> tuple[int, int]:
    """torch.distributed when initialised, else RANK / WORLD_SIZE, else a single process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@dataclass(frozen=True)
class ShardInfo:
    """What a stream needs to read its share of an epoch."""

    rank: int
    world_size: int
    epoch: int
    seed: int
    shuffle: bool


_shard_info: contextvars.ContextVar[ShardInfo | None] = contextvars.ContextVar(
    "aioloader_shard_info", default=None
)


def get_shard_info() -> ShardInfo:
    """Inside a stream's iteration: this rank, the world size, the epoch, the seed, shuffle.

    Outside a loader: rank 0 of 1 (or RANK / WORLD_SIZE), epoch 0, seed 0, no shuffle.
    """
    info = _shard_info.get()
    if info is None:
        rank, world_size = default_rank_and_world_size()
        return ShardInfo(rank, world_size, 0, 0, False)
    return info


def call_with_shard_info(info: ShardInfo, function: Callable[[], T]) -> T:
    """Call `function` in a copy of the current context where `get_shard_info()` is `info`
    (tasks it creates inherit that context); the caller's context is left alone."""

    def call() -> T:
        _shard_info.set(info)
        return function()

    return contextvars.copy_context().run(call)
