"""aioloader.Mix: weighted mixtures of sources, the same whatever the processes and world size,
resumed exactly."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import aioloader


class Numbers(aioloader.Dataset):
    """Items `base + i`, so that every sample names its source and index."""

    def __init__(self, base: int, count: int) -> None:
        self.base, self.count = base, count

    def __len__(self) -> int:
        return self.count

    async def fetch(self, index: int) -> int:
        return self.base + index


def tagged(item: aioloader.Mixed, rng: np.random.Generator) -> tuple[str, int, float]:
    """The source's name, the item, and a draw of the per-sample rng."""
    return item.source, int(item.item), float(rng.random())


def rows(loader: aioloader.Loader, limit: int | None = None,
         saved: list[dict[str, Any]] | None = None) -> list[tuple[str, int, float]]:
    """The rows of a pass, or of its first `limit` batches; then the state is put in `saved`,
    taken inside the loop, as a resumable job saves it."""
    out: list[tuple[str, int, float]] = []
    for n, (names, items, draws) in enumerate(loader):
        out += list(zip(names, items.tolist(), draws.tolist(), strict=True))
        if limit is not None and n + 1 == limit:
            if saved is not None:
                saved.append(json.loads(json.dumps(loader.state_dict())))
            break
    return out


def mixture(samples: int | None = None) -> aioloader.Mix:  # type: ignore[valid-type]
    return aioloader.Mix({"web": Numbers(0, 700), "code": Numbers(10_000, 200),
                          "books": Numbers(20_000, 100)},
                         weights=[0.6, 0.3, 0.1], samples_per_epoch=samples)


def test_each_source_gets_its_weight_over_20000_samples() -> None:
    loader = aioloader.Loader(mixture(20_000), decode=tagged, batch_size=500, num_workers=0)
    counts = Counter(name for name, _, _ in rows(loader))
    assert sum(counts.values()) == 20_000
    for name, weight in (("web", 0.6), ("code", 0.3), ("books", 0.1)):
        assert abs(counts[name] / 20_000 - weight) < 0.01, counts
    shares = loader.stats.sources
    assert abs(shares["web"] - 0.6) < 0.01 and set(shares) == {"web", "code", "books"}


def test_an_upweighted_small_source_starts_over_reshuffled() -> None:
    loader = aioloader.Loader(mixture(20_000), decode=tagged, batch_size=500, shuffle=True,
                              num_workers=0)
    books = [item - 20_000 for name, item, _ in rows(loader) if name == "books"]
    passes = [books[k : k + 100] for k in range(0, len(books) - 99, 100)]
    assert len(passes) >= 10
    assert all(sorted(p) == list(range(100)) for p in passes)  # each pass: every item once
    assert len({tuple(p) for p in passes}) == len(passes)  # each pass: a new order


def test_batches_are_the_same_for_0_and_2_decode_processes() -> None:
    def run(workers: int) -> list[tuple[str, int, float]]:
        with aioloader.Loader(mixture(), decode=tagged, batch_size=50, shuffle=True, seed=4,
                              num_workers=workers) as loader:
            return rows(loader)

    assert run(2) == run(0)


def test_world_sizes_1_and_2_give_the_same_mixture() -> None:
    with aioloader.Loader(mixture(), decode=tagged, batch_size=40, shuffle=True,
                          num_workers=0) as whole:
        one = rows(whole)
    ranks = []
    for rank in range(2):
        with aioloader.Loader(mixture(), decode=tagged, batch_size=20, shuffle=True,
                              num_workers=0, rank=rank, world_size=2) as part:
            ranks.append(rows(part))
    steps = [ranks[0][k : k + 20] + ranks[1][k : k + 20] for k in range(0, len(ranks[0]), 20)]
    assert [row for step in steps for row in step] == one


@pytest.mark.parametrize("break_at", [1, 7, 13])
def test_a_resumed_mixture_equals_the_uninterrupted_run(break_at: int) -> None:
    def make() -> aioloader.Loader:
        loader = aioloader.Loader(mixture(3_000), decode=tagged, batch_size=100, shuffle=True,
                                  seed=9, num_workers=0)
        loader.set_epoch(2)
        return loader

    uninterrupted = rows(make())
    first = make()
    saved: list[dict[str, Any]] = []
    taken = rows(first, limit=break_at, saved=saved)
    state = saved[0]
    assert set(state["sources"]) == {"web", "code", "books"}
    assert sum(s["pass"] * n + s["position"] for s, n in
               zip(state["sources"].values(), (700, 200, 100), strict=True)) == state["position"]
    second = make()
    second.load_state_dict(state)
    assert taken + rows(second) == uninterrupted


class Letters(aioloader.Stream):
    """A stream of 30 strings, sharded by rank."""

    def __len__(self) -> int:
        info = aioloader.get_shard_info()
        return len(range(info.rank, 30, info.world_size))

    async def __aiter__(self) -> AsyncIterator[str]:
        info = aioloader.get_shard_info()
        for n in range(info.rank, 30, info.world_size):
            yield f"letter-{n}"


def name_and_item(item: aioloader.Mixed) -> tuple[str, Any]:
    return item.source, str(item.item)


def test_a_stream_in_the_mixture_is_read_per_rank_and_resumed() -> None:
    mix = aioloader.Mix({"letters": Letters(), "numbers": Numbers(0, 50)}, weights=[1, 1],
                        samples_per_epoch=200)

    def make() -> aioloader.Loader:
        return aioloader.Loader(mix, decode=name_and_item, batch_size=10, num_workers=0)

    everything = [row for batch in make() for row in zip(*batch, strict=True)]
    assert len(everything) == 200
    letters = [item for name, item in everything if name == "letters"]
    assert letters[:30] == [f"letter-{n}" for n in range(30)]  # then the stream starts over
    first = make()
    taken = []
    for n, batch in enumerate(first):
        taken += list(zip(*batch, strict=True))
        if n == 5:
            state = first.state_dict()
            break
    second = make()
    second.load_state_dict(state)
    assert taken + [row for batch in second for row in zip(*batch, strict=True)] == everything


def test_mix_refuses_bad_weights_and_sources() -> None:
    with pytest.raises(ValueError, match="one weight"):
        aioloader.Mix({"a": Numbers(0, 3)}, weights=[1, 2])
    with pytest.raises(ValueError, match="one weight"):
        aioloader.Mix({"a": Numbers(0, 3), "b": Numbers(0, 3)}, weights=[0, 0])
    with pytest.raises(TypeError, match="Datasets and Streams"):
        aioloader.Mix({"a": Numbers(0, 3), "b": Letters(), "c": [1, 2]})
