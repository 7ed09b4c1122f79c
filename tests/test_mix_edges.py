"""aioloader.Mix at its edges: weights at the float limits, a state resumed into another
mixture, failed reads in the source shares, a source with nothing for a rank, read-ahead over
slow HTTP; and what the verdict says for streams, from_torch and a slow server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_mix import Letters, Numbers, mixture, name_and_item

import aioloader
from aioloader._stats import LoaderStats
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT


def source_names(loader: aioloader.Loader) -> list[str]:
    return [name for names, _ in loader for name in names]


@pytest.mark.parametrize("weight", [math.inf, math.nan, -math.inf])
def test_mix_refuses_a_weight_that_is_not_finite_naming_its_source(weight: float) -> None:
    with pytest.raises(ValueError, match="weight of source 'code' is"):
        aioloader.Mix({"web": Numbers(0, 3), "code": Numbers(0, 3)}, weights=[1, weight])


def test_weights_near_the_float_maximum_still_mix_both_sources() -> None:
    mix = aioloader.Mix({"web": Numbers(0, 50), "code": Numbers(100, 50)},
                        weights=[1e308, 1e308], samples_per_epoch=2_000)
    loader = aioloader.Loader(mix, decode=name_and_item, batch_size=100, num_workers=0)
    counts = Counter(source_names(loader))
    assert counts["web"] > 800 and counts["code"] > 800, counts


def saved(mix: Any, position: int) -> dict[str, Any]:
    """A loader's state for `mix` as it will be stored, through JSON."""
    state = {"epoch": 0, "position": position, "sources": mix.state_at(0, 0, position),
             "mixture": mix.fingerprint()}
    return dict(json.loads(json.dumps(state)))


def test_a_state_resumes_the_same_mixture_with_weights_written_otherwise() -> None:
    state = saved(mixture(), 1_234)
    same = aioloader.Mix({"web": Numbers(0, 700), "code": Numbers(10_000, 200),
                          "books": Numbers(20_000, 100)}, weights=[6, 3, 1])
    same.check_state(state)
    same.check_state({"epoch": 0, "position": 5})  # saved before mixtures described themselves


def test_resumed_mixture_refuses_other_weights_naming_the_source() -> None:
    state = saved(mixture(), 1_234)
    other = aioloader.Mix({"web": Numbers(0, 700), "code": Numbers(10_000, 200),
                           "books": Numbers(20_000, 100)}, weights=[0.5, 0.4, 0.1])
    with pytest.raises(aioloader.LoaderError,
                       match=r"'web' had weight 0\.6, now 0\.5; source 'code' had weight 0\.3"):
        other.check_state(state)


def test_resumed_mixture_refuses_a_source_of_another_length() -> None:
    state = saved(mixture(), 1_234)
    other = aioloader.Mix({"web": Numbers(0, 700), "code": Numbers(10_000, 250),
                           "books": Numbers(20_000, 100)}, weights=[0.6, 0.3, 0.1])
    with pytest.raises(aioloader.LoaderError, match="'code' had 200 samples, now 250"):
        other.check_state(state)


def test_resumed_stream_mixture_refuses_other_sources() -> None:
    mix = aioloader.Mix({"letters": Letters(), "numbers": Numbers(0, 50)},
                        samples_per_epoch=200)
    state = json.loads(json.dumps({"epoch": 0, "position": 7, "world_size": 1,
                                   "mixture": mix.fingerprint()}))
    mix.check_state(state)
    other = aioloader.Mix({"letters": Letters(), "digits": Numbers(0, 50)},
                          samples_per_epoch=200)
    with pytest.raises(aioloader.LoaderError, match=r"\['letters', 'numbers'\], not"):
        other.check_state(state)


class Flaky(Numbers):
    """Numbers whose item 3 cannot be read."""

    async def fetch(self, index: int) -> int:
        if index == 3:
            raise OSError("sector 3 unreadable")
        return await super().fetch(index)


def test_a_chunk_read_again_after_a_failure_counts_each_draw_once() -> None:
    mix = aioloader.Mix({"flaky": Flaky(0, 10), "steady": Numbers(100, 10)},
                        samples_per_epoch=200)
    loader = aioloader.Loader(mix, decode=name_and_item, batch_size=10, num_workers=0,
                              on_error="skip")
    counts = Counter(source_names(loader))
    assert loader.stats.skipped > 0
    total = sum(counts.values())
    assert loader.stats.sources == {name: round(counts[name] / total, 4)
                                    for name in ("flaky", "steady")}


PULL_ONE_BATCH = """
import asyncio, aioloader
from test_mix import Letters, Numbers, name_and_item

async def nothing():
    return
    yield

async def main():
    mix = aioloader.Mix({{{sources}}}, samples_per_epoch=40)
    loader = aioloader.Loader(mix, decode=name_and_item, batch_size=5, num_workers=0, {options})
    async with loader:
        async for _ in loader:
            break

asyncio.run(main())
"""


@pytest.mark.parametrize(("sources", "options", "error"), [
    ('"empty": aioloader.Stream.from_factory(nothing), "numbers": Numbers(0, 10)', "",
     "source 'empty' of the mixture gave no items for rank 0 of 1"),
    ('"letters": Letters(), "single": Numbers(0, 1)', "rank=1, world_size=2",
     "source 'single' of the mixture gave no items for rank 1 of 2"),
], ids=["an empty stream", "a source too small for rank 1"])
def test_a_source_with_nothing_for_this_rank_fails_naming_it(
    sources: str, options: str, error: str
) -> None:
    """In a child process: a loop that never awaits cannot be interrupted in this one."""
    script = PULL_ONE_BATCH.format(sources=sources, options=options)
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and f"LoaderError: {error}" in done.stderr, done.stderr


def test_map_sources_in_a_stream_mixture_read_as_far_ahead_as_concurrency(
    sample_dir: Path,
) -> None:
    with TestServer(sample_dir, latency_ms=50) as slow:
        urls = [f"{slow.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)] * 3
        mix = aioloader.Mix({"letters": Letters(), "files": aioloader.Files(urls)},
                            weights=[1, 9], samples_per_epoch=200)
        with aioloader.Loader(mix, decode=name_and_item, batch_size=20, num_workers=0,
                              concurrency=64) as loader:
            assert len(source_names(loader)) == 200
        assert slow.stats()["max_in_flight"] > 16


def stats(**figures: Any) -> LoaderStats:
    """Stats of a 10 s run of 10,000 samples whose consumer waited half the time."""
    made = LoaderStats(batches=100, samples=10_000, busy_seconds=10.0, **figures)
    made.consumer_wait.add(5.0)
    return made


def test_verdict_for_a_waiting_stream_names_its_read_ahead_not_concurrency() -> None:
    pulled = stats(stream=True, concurrency=1, decode_processes=2)
    pulled.fetch.add(0.0009, 10_000)  # waited 9 s of 10 for the next item
    verdict = pulled.verdict()
    assert verdict.startswith("bound by the stream") and "read-ahead" in verdict
    assert "raise concurrency" not in verdict


def test_verdict_for_from_torch_names_the_loads_in_the_decode_processes() -> None:
    loads = stats(load_threads=16, decode_processes=2, concurrency=64)
    loads.decode.add(0.032, 10_000)  # 320 s of __getitem__ on 32 threads in 10 s
    loads.fetch.add(0.000001, 10_000)  # fetch only passes indices on
    verdict = loads.verdict()
    assert verdict.startswith("bound by the loads in the decode processes")
    assert "io_threads" in verdict


def test_verdict_for_slow_reads_with_free_slots_does_not_ask_for_concurrency() -> None:
    slow = stats(concurrency=64, decode_processes=2)
    slow.fetch.add(0.002, 10_000)  # 2 reads in flight on average, of 64 allowed
    slow.decode.add(0.0001, 10_000)
    verdict = slow.verdict()
    assert verdict.startswith("bound by storage") and "2.0 of 64" in verdict
    assert "will not help" in verdict


def test_verdict_still_asks_for_concurrency_when_the_read_slots_are_full() -> None:
    busy = stats(concurrency=8, decode_processes=2)
    busy.fetch.add(0.008, 10_000)  # 8 reads in flight on average, of 8
    assert busy.verdict().endswith("raise concurrency")
    fast = stats(concurrency=64, decode_processes=2)
    fast.fetch.add(0.00001, 10_000)
    assert fast.verdict().startswith("bound by the event loop's own work")
