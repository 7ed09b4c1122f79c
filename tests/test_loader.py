"""The Loader end to end against files on disk and the HTTP test server on loopback."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import re
from pathlib import Path

import numpy as np
import psutil
import pytest

import aioloader
from aioloader._errors import RemoteTraceback
from aioloader.testing import TestServer

from decoders import (
    SAMPLE_COUNT,
    die_on_five,
    fail_on_seven,
    index_and_noise,
    index_of,
    mark_worker,
    refuse_to_start,
    slow_worker_id,
    start_late,
    whoami,
)


def indices(batches: list[np.ndarray]) -> list[list[int]]:
    return [b.tolist() for b in batches]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_sequential_epoch_has_every_sample_in_order(urls: list[str]) -> None:
    with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=32) as loader:
        batches = indices(list(loader))
    assert [len(b) for b in batches] == [32, 32, 32, 4]
    assert flat(batches) == list(range(SAMPLE_COUNT))
    assert len(loader) == 4


def test_drop_last_drops_the_partial_batch(local_paths: list[str]) -> None:
    loader = aioloader.Loader(
        aioloader.Files(local_paths), decode=index_of, batch_size=32, drop_last=True, num_workers=0
    )
    batches = indices(list(loader))
    assert len(loader) == len(batches) == 3
    assert flat(batches) == list(range(96))


def test_shuffle_is_reproducible_per_seed_and_epoch(local_paths: list[str]) -> None:
    def epoch_order(seed: int, epoch: int) -> list[int]:
        loader = aioloader.Loader(
            aioloader.Files(local_paths), decode=index_of, batch_size=10, shuffle=True,
            seed=seed, num_workers=0,
        )
        loader.set_epoch(epoch)
        return flat(indices(list(loader)))

    first = epoch_order(seed=1, epoch=0)
    assert sorted(first) == list(range(SAMPLE_COUNT))
    assert first != list(range(SAMPLE_COUNT))
    assert epoch_order(seed=1, epoch=0) == first
    assert epoch_order(seed=1, epoch=1) != first
    assert epoch_order(seed=2, epoch=0) != first


def test_each_full_pass_moves_to_the_next_epoch(local_paths: list[str]) -> None:
    loader = aioloader.Loader(
        aioloader.Files(local_paths), decode=index_of, batch_size=10, shuffle=True, num_workers=0
    )
    epoch0 = flat(indices(list(loader)))
    assert loader.epoch == 1
    epoch1 = flat(indices(list(loader)))
    loader.set_epoch(0)
    assert flat(indices(list(loader))) == epoch0 != epoch1


@pytest.mark.parametrize("num_workers", [1, 4])
@pytest.mark.parametrize("concurrency", [1, 64])
def test_batches_identical_whatever_the_workers_and_concurrency(
    urls: list[str], num_workers: int, concurrency: int
) -> None:
    def run(workers: int, reads: int) -> list[dict[str, np.ndarray]]:
        with aioloader.Loader(
            aioloader.Files(urls), decode=index_and_noise, batch_size=16, shuffle=True, seed=3,
            num_workers=workers, concurrency=reads,
        ) as loader:
            return list(loader)

    reference = run(0, 8)
    batches = run(num_workers, concurrency)
    assert len(batches) == len(reference)
    for got, want in zip(batches, reference, strict=True):
        np.testing.assert_array_equal(got["index"], want["index"])
        np.testing.assert_array_equal(got["noise"], want["noise"])


def test_unordered_delivers_every_sample_once(urls: list[str]) -> None:
    with aioloader.Loader(
        aioloader.Files(urls), decode=index_of, batch_size=8, ordered=False, concurrency=16
    ) as loader:
        seen = sorted(flat(indices(list(loader))))
    assert seen == list(range(SAMPLE_COUNT))


def test_unbatched_yields_samples(urls: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=None)
    with loader:
        assert list(loader) == list(range(SAMPLE_COUNT))
    assert len(loader) == SAMPLE_COUNT


def test_labels_come_with_the_bytes(urls: list[str]) -> None:
    labels = [i % 3 for i in range(SAMPLE_COUNT)]
    with aioloader.Loader(aioloader.Files(urls, labels), batch_size=50, num_workers=0) as loader:
        raws, batch_labels = next(iter(loader))
    assert [index_of(r) for r in raws] == list(range(50))
    assert batch_labels.tolist() == labels[:50]


async def test_async_for_and_plain_for_on_one_loader(urls: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=25)
    async with loader:
        first = [b.tolist() async for b in loader]
        second = await asyncio.to_thread(lambda: indices(list(loader)))
    assert first == second
    assert flat(first) == list(range(SAMPLE_COUNT))


def test_worker_info_and_legacy_seeds_differ_per_worker(urls: list[str]) -> None:
    assert aioloader.get_worker_info() is None
    with aioloader.Loader(aioloader.Files(urls), decode=whoami, batch_size=4) as loader:
        rows = [row for batch in loader for row in zip(*batch, strict=True)]
    assert sorted(int(r[0]) for r in rows) == list(range(SAMPLE_COUNT))
    by_worker = {int(r[1]): (int(r[2]), int(r[3])) for r in rows}
    assert set(by_worker) <= {0, 1} and len(by_worker) == 2
    assert all(n == 2 for n, _ in by_worker.values())
    assert len({seed for _, seed in by_worker.values()}) == 2
    first_draws = {}
    for r in rows:
        first_draws.setdefault(int(r[1]), (float(r[4]), int(r[5])))
    assert first_draws[0] != first_draws[1]


@pytest.mark.parametrize("service", ["process", None])
def test_a_passs_first_batch_is_decoded_by_every_process_at_once(
    local_paths: list[str], service: str | None
) -> None:
    """Divided among the decode processes and joined, the first batch comes sooner; the
    batches are those of one process each."""
    loader = aioloader.Loader(aioloader.Files(local_paths[:32]), decode=whoami, batch_size=8,
                              num_workers=2, persistent_workers=True, service=service)
    with loader:
        list(loader)  # the processes start: the next pass finds both ready
        batches = [(batch[0].tolist(), set(batch[1].tolist())) for batch in loader]
        inline = aioloader.Loader(aioloader.Files(local_paths[:32]), decode=index_of,
                                  batch_size=8, num_workers=0)
    assert [indices for indices, _ in batches] == [b.tolist() for b in inline]
    assert batches[0][1] == {0, 1}
    assert all(len(workers) == 1 for _, workers in batches[1:])


@pytest.mark.parametrize("service", ["process", None])
def test_a_fresh_loaders_first_batch_waits_for_a_process_still_starting(
    local_paths: list[str], service: str | None
) -> None:
    """A part of the first batch goes to a process still starting rather than queueing
    behind the other part in the one process already up: every process decodes at once."""
    loader = aioloader.Loader(aioloader.Files(local_paths[:8]), decode=slow_worker_id,
                              batch_size=8, num_workers=2, worker_init=start_late,
                              service=service)
    with loader:
        first = next(iter(loader))
    assert set(first.tolist()) == {0, 1}


def test_worker_init_runs_once_in_each_worker(urls: list[str], tmp_path: Path) -> None:
    init = functools.partial(mark_worker, str(tmp_path))
    with aioloader.Loader(
        aioloader.Files(urls), decode=index_of, batch_size=4, worker_init=init
    ) as loader:
        list(loader)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0", "worker-1"]


def test_decode_error_names_the_sample_and_keeps_the_traceback(
    urls: list[str], leak_check: None
) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=fail_on_seven, batch_size=4)
    with pytest.raises(aioloader.LoaderError) as caught:
        list(loader)
    message = str(caught.value)
    assert "sample 7" in message and urls[7] in message
    assert "ZeroDivisionError: sample seven is cursed" in message and "\n" not in message
    assert isinstance(caught.value.__cause__, RemoteTraceback)
    assert "fail_on_seven" in str(caught.value.__cause__)  # the decode process's traceback
    del loader


@pytest.mark.parametrize("service", [None, "process"])
def test_an_error_in_decode_is_also_its_own_type_as_dataloader_reraises_it(
    urls: list[str], service: str | None
) -> None:
    with aioloader.Loader(aioloader.Files(urls), decode=fail_on_seven, batch_size=4,
                          service=service) as loader, pytest.raises(ZeroDivisionError) as caught:
        list(loader)
    assert isinstance(caught.value, aioloader.SampleError) and caught.value.index == 7
    assert "sample seven is cursed" in str(caught.value)


@pytest.mark.parametrize(("service", "workers"), [(None, 0), (None, 2), ("process", 2)])
def test_a_caught_error_of_one_batch_lets_the_pass_go_on_as_dataloader_does(
    urls: list[str], service: str | None, workers: int
) -> None:
    with aioloader.Loader(aioloader.Files(urls[:40]), decode=fail_on_seven, batch_size=4,
                          num_workers=workers, service=service) as loader:
        batches, errors = iter(loader), 0
        got = []
        while True:
            try:
                got.append(next(batches).tolist())
            except StopIteration:
                break
            except ZeroDivisionError:
                errors += 1
        assert errors == 1 and flat(got) == [i for i in range(40) if i // 4 != 1]
        assert loader.epoch == 1  # the pass ran to its end
        assert next(iter(loader)).tolist() == [0, 1, 2, 3]  # and the next one starts


def test_a_caught_error_of_one_sample_unbatched_goes_on_to_the_end(urls: list[str]) -> None:
    """Unbatched, samples are decoded 16 to a task: the failing sample's task (0-15) is lost
    with it, and the pass goes on after it (it used to wait for the task's other steps)."""
    with aioloader.Loader(aioloader.Files(urls[:40]), decode=fail_on_seven, batch_size=None,
                          num_workers=2) as loader:
        samples, got = iter(loader), []
        with pytest.raises(ZeroDivisionError):
            while True:
                got.append(int(next(samples)))
        got.extend(int(sample) for sample in samples)
    assert got == list(range(16, 40))


async def test_a_caught_error_lets_an_async_pass_go_on(urls: list[str]) -> None:
    async with aioloader.Loader(aioloader.Files(urls[:24]), decode=fail_on_seven,
                                batch_size=4) as loader:
        batches, got = aiter(loader), []
        for _ in range(6):
            try:
                got.append((await anext(batches)).tolist())
            except ZeroDivisionError:
                got.append("error")
        assert got[1] == "error" and flat([b for b in got if b != "error"]) == [
            i for i in range(24) if i // 4 != 1]


def test_an_error_in_worker_init_is_its_own_type(urls: list[str]) -> None:
    with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=4,
                          worker_init=refuse_to_start) as loader, pytest.raises(
            PermissionError, match="worker_init failed") as caught:
        list(loader)
    assert isinstance(caught.value, aioloader.LoaderError)


def test_timeouts_and_dead_workers_are_runtime_errors_as_in_dataloader() -> None:
    for kind in (aioloader.WorkerDiedError, aioloader.DecodeTimeoutError, aioloader.StallError):
        assert issubclass(kind, RuntimeError) and issubclass(kind, aioloader.LoaderError)


def test_missing_file_names_the_url_and_status(server: TestServer, urls: list[str]) -> None:
    broken = [*urls[:10], server.url + "nope.bin"]
    with pytest.raises(aioloader.LoaderError) as caught:
        list(aioloader.Loader(aioloader.Files(broken), decode=index_of, num_workers=0))
    assert server.url + "nope.bin" in str(caught.value) and "HTTP 404" in str(caught.value)


def test_skip_counts_and_drops_bad_samples(server: TestServer, urls: list[str]) -> None:
    broken = [*urls[:20], server.url + "nope.bin"]
    loader = aioloader.Loader(
        aioloader.Files(broken), decode=fail_on_seven, batch_size=4, on_error="skip"
    )
    with loader:
        seen = flat(indices(list(loader)))
    assert seen == [i for i in range(20) if i != 7]
    assert loader.stats.skipped == 2
    assert any("sample 7" in r for r in loader.stats.skip_reasons)
    assert any("nope.bin" in r for r in loader.stats.skip_reasons)


def test_killed_decode_process_raises_instead_of_hanging(urls: list[str], leak_check: None) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=die_on_five, batch_size=4)
    with pytest.raises(aioloader.WorkerDiedError) as caught:
        list(loader)
    message = str(caught.value)  # the poison sample is named, with the signal that killed
    assert "killed a decode process twice (killed by SIGKILL)" in message
    assert re.search(r"samples \[?[^]]*\b5\b", message), message
    loader.close()


def test_break_mid_epoch_leaves_no_processes(urls: list[str], leak_check: None) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=4)
    for n, _ in enumerate(loader):
        if n == 2:
            break


async def test_async_break_mid_epoch_leaves_no_processes(urls: list[str]) -> None:
    from conftest import snapshot

    before = snapshot()
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=4)
    async for n, _ in _aenumerate(loader):
        if n == 2:
            break
    decode_left = []
    for _ in range(100):  # the loader service lives until close; its decode processes do not
        decode_left = [p for p in psutil.Process().children(recursive=True)
                       if p.name() == "aioloader-dec"]
        if not decode_left:
            break
        await asyncio.sleep(0.05)
    assert not decode_left
    loader.close()
    for _ in range(100):
        gc.collect()
        await asyncio.sleep(0.05)
        now = snapshot()
        clean = now.processes <= before.processes and now.threads <= before.threads
        if clean and now.sockets <= before.sockets:
            break
    assert now.processes <= before.processes and now.threads <= before.threads
    assert now.sockets <= before.sockets


async def _aenumerate(loader: aioloader.Loader):  # type: ignore[no-untyped-def]
    n = 0
    async for item in loader:
        yield n, item
        n += 1


def test_exception_in_consumer_leaves_nothing_behind(urls: list[str], leak_check: None) -> None:
    loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=4)
    with pytest.raises(KeyError), loader:
        for _ in loader:
            raise KeyError("consumer bug")


def test_dropping_the_last_reference_mid_epoch_cleans_up(urls: list[str], leak_check: None) -> None:
    loader = aioloader.Loader(
        aioloader.Files(urls), decode=index_of, batch_size=4, persistent_workers=True
    )
    iterator = iter(loader)
    next(iterator)
    del iterator, loader


def test_close_is_idempotent_and_final(urls: list[str], leak_check: None) -> None:
    loader = aioloader.Loader(
        aioloader.Files(urls), decode=index_of, batch_size=4, persistent_workers=True
    )
    with loader:
        list(loader)
    loader.close()
    loader.close()
    with pytest.raises(aioloader.LoaderError, match="closed"):
        list(loader)


def test_state_dict_resumes_with_the_same_batches(local_paths: list[str]) -> None:
    def make() -> aioloader.Loader:
        return aioloader.Loader(
            aioloader.Files(local_paths), decode=index_of, batch_size=8, shuffle=True, seed=5,
            num_workers=0,
        )

    uninterrupted = indices(list(make()))
    first = make()
    taken = []
    for batch in first:
        taken.append(batch.tolist())
        if len(taken) == 5:
            state = json.loads(json.dumps(first.state_dict()))
            break
    second = make()
    second.load_state_dict(state)
    assert taken + indices(list(second)) == uninterrupted


def test_ranks_take_disjoint_shares_that_cover_the_epoch(local_paths: list[str]) -> None:
    shares = []
    for rank in range(3):
        loader = aioloader.Loader(
            aioloader.Files(local_paths), decode=index_of, batch_size=8, shuffle=True,
            rank=rank, world_size=3, num_workers=0,
        )
        shares.append(flat(indices(list(loader))))
    assert len({len(s) for s in shares}) == 1
    covered = set().union(*shares)
    assert covered == set(range(SAMPLE_COUNT))
    assert sum(map(len, shares)) - len(covered) == 3 - SAMPLE_COUNT % 3  # padding wraps around


class LoopSpy(aioloader.Dataset):
    """Records which event loop class runs fetch."""

    def __init__(self) -> None:
        self.loops: set[str] = set()

    def __len__(self) -> int:
        return 4

    async def fetch(self, index: int) -> int:
        self.loops.add(type(asyncio.get_running_loop()).__module__)
        return index


def test_plain_for_runs_uvloop_when_installed() -> None:
    pytest.importorskip("uvloop")
    dataset = LoopSpy()
    assert list(aioloader.Loader(dataset, batch_size=2, num_workers=0))[1].tolist() == [2, 3]
    assert dataset.loops == {"uvloop"}


def test_auto_concurrency_grows_while_reads_are_the_bottleneck(sample_dir: Path) -> None:
    with TestServer(sample_dir, latency_ms=40) as slow:
        urls = [f"{slow.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)] * 20
        loader = aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=16,
                                  concurrency="auto", num_workers=0)
        with loader:
            assert len(flat(indices(list(loader)))) == len(urls)
        assert loader.stats.concurrency > 16
        assert slow.stats()["max_in_flight"] > 16
