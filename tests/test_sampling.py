"""Epoch order and rank shares, for any length, batch size and world size."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._sampling import EpochPlan, epoch_order, steps_in_epoch


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 300),
    step=st.integers(1, 17),
    world_size=st.integers(1, 5),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_rank_shares_are_equal_and_cover_the_epoch(
    length: int, step: int, world_size: int, drop_last: bool, shuffle: bool, seed: int
) -> None:
    order = epoch_order(length, shuffle, seed, epoch=0)
    plans = [EpochPlan(order, step, r, world_size, drop_last) for r in range(world_size)]
    shares = [np.concatenate([p.step(k) for k in range(len(p))] or [np.empty(0, np.int64)])
              for p in plans]
    assert len({len(p) for p in plans}) == 1
    assert len(plans[0]) == steps_in_epoch(length, step, world_size, drop_last)
    assert len({len(s) for s in shares}) == 1
    assert all(len(p.step(k)) <= step for p in plans for k in range(len(p)))
    taken = np.concatenate(shares)
    if drop_last:
        assert len(set(taken.tolist())) == len(taken)  # nothing twice
        assert length - len(taken) < step * world_size  # at most one partial step dropped
    else:
        assert set(taken.tolist()) == set(range(length))
        assert len(taken) - length < world_size  # padding wraps at most world_size - 1


@given(length=st.integers(2, 500), seed=st.integers(0, 1000))
def test_order_depends_only_on_seed_and_epoch(length: int, seed: int) -> None:
    first = epoch_order(length, True, seed, 3)
    assert np.array_equal(first, epoch_order(length, True, seed, 3))
    assert sorted(first.tolist()) == list(range(length))
