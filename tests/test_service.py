"""The loader service: the pass in a process of its own, the trainer a thin client on a socket.

Every test compares with the loader in the caller's process (`service=None`) or checks what
the training process sees: batches, positions, errors, stats, and what is left behind.
"""

from __future__ import annotations

import asyncio
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from segments import blocks
from test_tarshards import write_shards

import aioloader
from aioloader._iteration.handles import ServiceHandle

from conftest import ended
from decoders import (
    big_image,
    die_on_five,
    fail_on_seven,
    index_and_noise,
    index_of,
    stuck_on_five,
    two_megabytes,
)

SERVICES = [None, "process"]


def _plain(batch: Any) -> Any:
    """A batch as plain Python, to compare runs (and to outlive the block it views)."""
    if isinstance(batch, dict):
        return {key: _plain(value) for key, value in batch.items()}
    if isinstance(batch, np.ndarray):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [_plain(part) for part in batch]
    return batch


def _epochs(loader: aioloader.Loader, epochs: int = 2) -> list[Any]:
    seen = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        seen.append([_plain(batch) for batch in loader])
    return seen


def test_the_service_gives_the_batches_the_callers_process_gives(urls: list[str]) -> None:
    runs = {}
    for service in SERVICES:
        with aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=8,
                              shuffle=True, seed=5, drop_last=True, service=service) as loader:
            assert loader.config.service == service
            runs[service] = _epochs(loader)
    assert runs[None] == runs["process"]
    assert runs[None][0] != runs[None][1]


def test_the_service_is_the_default_with_decode_processes_and_not_without(
    urls: list[str],
) -> None:
    assert aioloader.Loader(aioloader.Files(urls), num_workers=2).config.service == "process"
    assert aioloader.Loader(aioloader.Files(urls), num_workers=0).config.service is None


def test_a_served_stream_of_tar_shards_and_unbatched_samples_match(tmp_path: Path) -> None:
    shards = [str(tmp_path / name) for name in write_shards(tmp_path, shards=3, per_shard=7)]
    runs = {}
    for service in SERVICES:
        for batch_size in (None, 4):
            with aioloader.Loader(aioloader.TarShards(shards), batch_size=batch_size,
                                  shuffle=True, decode=_txt, world_size=2, rank=1,
                                  service=service) as loader:
                runs[service, batch_size] = (_epochs(loader), len(loader))
    assert runs[None, None] == runs["process", None]
    assert runs[None, 4] == runs["process", 4]


def _txt(sample: dict[str, bytes]) -> str:
    return sample["cls"].decode()


def test_large_batches_are_views_of_shared_memory_kept_intact_while_held(
    urls: list[str],
) -> None:
    with aioloader.Loader(aioloader.Files(urls[:40]), decode=big_image, batch_size=4,
                          memory_limit=2 << 20) as loader:
        kept = list(loader)
        assert all(isinstance(batch.base, np.ndarray) for batch in kept)
        for n, batch in enumerate(kept):  # later batches never reused a held block
            assert batch[:, 0, 0, 0].tolist() == list(range(4 * n, 4 * n + 4))
        assert loader.stats.transport["shared"] >= 1
        assert len(list(loader)) == 10  # a second epoch once the first is let go of
        del kept


def test_a_break_then_a_new_pass_and_the_state_match_the_callers_process(
    urls: list[str],
) -> None:
    seen = {}
    for service in SERVICES:
        with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=5,
                              shuffle=True, service=service) as loader:
            for n, _ in enumerate(loader):
                if n == 3:
                    state = loader.state_dict()
                    break
            after = loader.state_dict()
            again = [_plain(b) for b in loader]  # a new pass starts the next epoch
            loader.load_state_dict(state)
            loader.set_epoch(state["epoch"])  # as a training loop does when it resumes
            left = len(loader)
            resumed = [_plain(b) for b in loader]
            seen[service] = (state, after, again, left, resumed, loader.state_dict())
    assert seen[None] == seen["process"]
    state, after, again, left, resumed, _ = seen[None]
    assert state["position"] == 20 and (after["epoch"], after["position"]) == (1, 0)
    assert left == len(resumed) == 20 - 4


def test_async_for_awaits_the_service_in_the_callers_loop(urls: list[str]) -> None:
    async def both() -> tuple[list[Any], list[Any]]:
        with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=7) as loader:
            whole = [_plain(b) async for b in loader]
            part = []
            async for batch in loader:
                part.append(_plain(batch))
                if len(part) == 2:
                    break
            return whole, part

    whole, part = asyncio.run(asyncio.wait_for(both(), 60))
    assert whole[:2] == part
    assert sum(len(b) for b in whole) == 100


@pytest.mark.parametrize("service", SERVICES)
def test_a_failed_decode_raises_the_same_error_at_the_same_batch(
    urls: list[str], service: str | None
) -> None:
    with aioloader.Loader(aioloader.Files(urls), decode=fail_on_seven, batch_size=3,
                          service=service) as loader:
        got = []
        with pytest.raises(aioloader.SampleError) as caught:
            for batch in loader:
                got.append(_plain(batch))
        assert got == [[0, 1, 2], [3, 4, 5]]
        assert "sample seven is cursed" in str(caught.value)
        assert caught.value.index == 7
        assert "ZeroDivisionError" in str(caught.value.__cause__)
        again = []
        with pytest.raises(aioloader.SampleError):  # the next pass starts anew
            for batch in loader:
                again.append(_plain(batch))
        assert again == got


def test_skipped_samples_are_counted_in_the_services_stats(urls: list[str]) -> None:
    with aioloader.Loader(aioloader.Files(urls), decode=fail_on_seven, batch_size=10,
                          on_error="skip") as loader:
        assert sum(len(b) for b in loader) == 99
        stats = loader.stats
        assert (stats.skipped, stats.samples, stats.batches) == (1, 99, 10)
        assert "sample seven" in stats.skip_reasons[0]


def test_a_decode_timeout_and_a_killed_decode_process_reach_the_trainer(
    urls: list[str],
) -> None:
    with aioloader.Loader(aioloader.Files(urls[:20]), decode=stuck_on_five, batch_size=4,
                          decode_timeout=1.0) as loader, pytest.raises(
            aioloader.DecodeTimeoutError, match="decode_timeout"):
        list(loader)
    with pytest.warns(RuntimeWarning, match="ended abruptly"), aioloader.Loader(
            aioloader.Files(urls[:20]), decode=die_on_five, batch_size=4) as loader, \
            pytest.raises(aioloader.WorkerDiedError):
        list(loader)


def test_stats_and_the_timeline_show_the_services_work_while_a_pass_runs(
    urls: list[str], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=10) as loader:
        for n, _ in enumerate(loader):
            if n == 4:
                stats = loader.stats
                assert stats.batches == 5
                assert stats.fetch.count >= 50 and stats.requests >= 50
        assert loader.stats.samples == 100
        assert loader.timeline(tmp_path / "t.png").stat().st_size > 0
        for n, _ in enumerate(loader):
            if n == 4:  # the second pass's figures, not those the first left at its end
                assert loader.stats.samples >= 150
                break


def test_close_from_another_thread_stops_a_pass_waiting_on_the_service(
    urls: list[str], leak_check: None
) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=stuck_on_five, batch_size=10)
    threading.Timer(1.0, loader.close).start()
    with pytest.raises(aioloader.LoaderError, match="closed"):
        list(loader)
    with pytest.raises(aioloader.LoaderError, match="closed"):
        list(loader)


def test_a_dataset_that_cannot_be_pickled_fails_at_once_suggesting_service_none(
    urls: list[str],
) -> None:
    class Locked(aioloader.Files):
        lock = threading.Lock()

        def __reduce__(self) -> Any:
            return (Locked, (self.lock,))

    data = Locked(urls)
    data.lock = threading.Lock()
    with pytest.raises(ValueError, match="service=None"):
        aioloader.Loader(data, decode=index_of)
    with aioloader.Loader(data, decode=index_of, service=None, batch_size=50) as loader:
        assert len(list(loader)) == 2


def test_the_torch_bridge_gives_tensors_over_the_services_blocks(urls: list[str]) -> None:
    torch = pytest.importorskip("torch")
    from aioloader.torch import TorchLoader

    with aioloader.Loader(aioloader.Files(urls[:8]), decode=two_megabytes,
                          batch_size=2) as loader:
        batches = list(TorchLoader(loader))
        assert all(isinstance(b, torch.Tensor) for b in batches)
        assert [int(b[0, 0, 0]) for b in batches] == [0, 2, 4, 6]
        assert loader.stats.transport["shared"] == 4


KILLED_TRAINER = textwrap.dedent("""
    import os, sys, time
    import aioloader
    sys.path.insert(0, {tests!r})
    from decoders import two_megabytes
    loader = aioloader.Loader(aioloader.Files({urls!r}), decode=two_megabytes, batch_size=2,
                              persistent_workers=True)
    held = []
    for batch in loader:
        held.append(batch)
        if len(held) == 3:
            print(os.getpid(), flush=True)
            time.sleep(600)
""")


def test_a_sigkilled_trainer_takes_its_service_decode_processes_and_blocks_with_it(
    urls: list[str],
) -> None:
    script = KILLED_TRAINER.format(tests=str(Path(__file__).parent), urls=urls[:40])
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        assert int(trainer.stdout.readline()) == trainer.pid
        family = psutil.Process(trainer.pid).children(recursive=True)
        services = [p for p in family if p.pid != trainer.pid and any(
            c.pid in {f.pid for f in family} for c in p.children())]
        assert services, "no loader service with decode processes under the trainer"
        made = set(blocks([trainer.pid, *(p.pid for p in family)]))
        assert made
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
    wait_until_gone(family, made)


def wait_until_gone(family: list[psutil.Process], made: set[int]) -> None:
    """Fail unless every process of `family` has ended, and no process holds or maps any of
    the blocks `made` any more, within 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in family if not ended(p)]
        left = made & set(blocks())
        if not alive and not left:
            return
        time.sleep(0.1)
    pytest.fail(f"left behind: processes {alive}, blocks {left}")


def test_an_error_that_cannot_be_pickled_still_reaches_the_trainer_by_name(
    urls: list[str],
) -> None:
    from aioloader._service.server import _portable

    class Odd(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(f"odd {a} {b}")

    error, text = _portable(Odd(1, 2))
    assert isinstance(error, aioloader.LoaderError) and "Odd: odd 1 2" in str(error)
    assert "Odd" in text
    sample_error = aioloader.SampleError(3, "k", "decode", "boom")
    again = pickle.loads(pickle.dumps(sample_error))
    assert (type(again), str(again), again.index) == (aioloader.SampleError, str(sample_error), 3)


def test_stats_asked_between_batches_of_an_async_pass_never_strand_the_pass(
    urls: list[str],
) -> None:
    """Asking for stats reads the socket too, and may bring the next batches in with the
    reply: the pass must find them there rather than wait for the socket."""

    async def watched() -> list[int]:
        counts = []
        with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=5) as loader:
            async for _ in loader:
                counts.append(loader.stats.batches)
        return counts

    assert asyncio.run(asyncio.wait_for(watched(), 60)) == list(range(1, 21))


def test_a_broken_off_pass_whose_stop_is_unanswered_does_not_leak_into_the_next(
    urls: list[str],
) -> None:
    with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=10) as loader:
        for _ in range(3):  # three passes stopped without waiting, as dropped iterators are
            handle = loader._runner.open()
            assert isinstance(handle, ServiceHandle)
            handle.close(wait=False)
        assert [_plain(b) for b in loader] == [list(range(n, n + 10)) for n in range(0, 100, 10)]
