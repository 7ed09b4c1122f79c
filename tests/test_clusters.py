"""Decoding on a cluster (`executor=`): a Dask client or Ray keeps every guarantee of the
built-in pool, tested on a real local cluster of each (processes on 127.0.0.1)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import aioloader

from decoders import (
    RELEASE,
    SAMPLE_COUNT,
    blocked_on_five_and_nine,
    die_on_five,
    fail_on_seven,
    index_and_noise,
    index_of,
    slow_index,
    stuck_on_five_a_while,
    two_megabytes_marked,
)


@pytest.fixture(scope="module")
def dask_client() -> Iterator[Any]:
    """Two worker processes of one thread each; a worker lost is always Dask's to report
    (allowed-failures 0), so that max_worker_restarts counts every death."""
    distributed = pytest.importorskip("distributed")
    dask = pytest.importorskip("dask")
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=None, host="127.0.0.1") as cluster, \
            distributed.Client(cluster) as client:
        yield client


@pytest.fixture(scope="module")
def ray_client() -> Iterator[str]:
    """A local Ray cluster of 2 CPUs started by this process (on loopback: Ray's switch for
    single-machine clusters), so `executor="ray"` finds it running, and leaves it so."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is imported
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             object_store_memory=300_000_000,
             configure_logging=False)
    session = ray._private.worker._global_node.get_session_dir_path()
    try:
        yield "ray"
    finally:
        ray.shutdown()
        shutil.rmtree(session, ignore_errors=True)  # Ray leaves its logs and sockets there


@pytest.fixture(params=["dask", "ray"])
def cluster(request: pytest.FixtureRequest) -> Any:
    """What `executor=` is given for each backend; Dask's with both workers up (a test before
    may have killed or restarted one, which its nanny brings back in the background)."""
    executor = request.getfixturevalue(f"{request.param}_client")
    if request.param == "dask":
        executor.wait_for_workers(2, timeout=60)
    return executor


def worker_pids(executor: Any) -> list[int]:
    """The pids of the cluster's decode workers (Ray: the actors of the loader running now)."""
    if executor == "ray":  # titled ray::DecodeActor, or ray::DecodeActor.decode() while busy
        return sorted(int(p.pid) for p in psutil.process_iter(["cmdline"])
                      if " ".join(p.info["cmdline"] or []).startswith("ray::DecodeActor"))
    return sorted(executor.run(os.getpid).values())


def busy_worker(executor: Any) -> int:
    """The pid of a worker decoding a chunk now (Dask may queue both on one worker), looked
    for up to 10 s (between two chunks none may be)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if executor == "ray":
            busy = [int(p.pid) for p in psutil.process_iter(["cmdline"])
                    if " ".join(p.info["cmdline"] or []).startswith("ray::DecodeActor.decode")]
            if busy:
                return busy[0]
        else:
            working = [worker for worker, keys in executor.processing().items() if keys]
            if working:
                pids: dict[str, int] = executor.run(os.getpid, workers=working[:1])
                return next(iter(pids.values()))
        time.sleep(0.01)
    pytest.fail("no worker was busy for 10 s")


def wait_until(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def run(local_paths: list[str], **options: Any) -> list[Any]:
    options = {"decode": index_and_noise, "batch_size": 16, "shuffle": True, **options}
    with aioloader.Loader(aioloader.Files(local_paths), **options) as loader:
        return list(loader)


def assert_same_batches(got: list[Any], reference: list[Any]) -> None:
    assert len(got) == len(reference)
    for mine, theirs in zip(got, reference, strict=True):
        np.testing.assert_array_equal(mine["index"], theirs["index"])
        np.testing.assert_array_equal(mine["noise"], theirs["noise"])


def test_batches_equal_the_built_in_pool(cluster: Any, local_paths: list[str]) -> None:
    assert_same_batches(run(local_paths, executor=cluster, num_workers=2),
                        run(local_paths, num_workers=2))


def test_decode_timeout_raises_as_the_pool_does_naming_where_it_ran(
    cluster: Any, local_paths: list[str]
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=stuck_on_five_a_while,
                              batch_size=4, decode_timeout=1, executor=cluster)
    with pytest.raises(aioloader.DecodeTimeoutError) as caught, loader:
        list(loader)
    message = str(caught.value)
    assert "samples [4, 5, 6, 7]" in message and "decode_timeout=1" in message


def test_decode_timeout_with_skip_drops_only_the_stuck_batch(
    cluster: Any, local_paths: list[str]
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=stuck_on_five_a_while,
                              batch_size=4, decode_timeout=1, on_error="skip", executor=cluster)
    with loader:
        seen = [int(i) for batch in loader for i in batch]
    assert seen == [i for i in range(SAMPLE_COUNT) if i not in (4, 5, 6, 7)]
    assert loader.stats.skipped == 4 and loader.stats.decode_timeouts == 1
    assert loader.stats.worker_restarts == 0  # a worker freed is not one lost (nor reused early)


def test_the_stall_watchdog_names_the_oldest_task_and_its_worker(
    cluster: Any, local_paths: list[str]
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=stuck_on_five_a_while,
                              batch_size=4, stall_timeout=2, executor=cluster)
    with pytest.raises(aioloader.StallError) as caught, loader:
        list(loader)
    assert re.search(r"samples \[4, 5, 6, 7\] on (Dask worker tcp://127\.0\.0\.1:\d+|"
                     r"Ray actor \d \(pid \d+ on 127\.0\.0\.1\))", str(caught.value))


def test_on_error_skips_and_raises_as_the_pool_does(cluster: Any, local_paths: list[str]) -> None:
    options = {"decode": fail_on_seven, "batch_size": 4, "on_error": "skip"}
    assert [list(b) for b in run(local_paths, executor=cluster, **options)] == [
        list(b) for b in run(local_paths, num_workers=2, **options)]
    with pytest.raises(aioloader.LoaderError, match="sample seven is cursed"):
        run(local_paths, executor=cluster, decode=fail_on_seven, batch_size=4)


def test_a_killed_worker_costs_a_retry_of_its_chunk_not_the_pass(
    cluster: Any, local_paths: list[str]
) -> None:
    reference = run(local_paths * 2, decode=slow_index, shuffle=False)
    loader = aioloader.Loader(aioloader.Files(local_paths * 2), decode=slow_index, batch_size=16,
                              executor=cluster, num_workers=2)
    got = []
    with loader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n, batch in enumerate(loader):
            got.append(batch)
            if n == 1:
                os.kill(busy_worker(cluster), signal.SIGKILL)
    assert [list(b) for b in got] == [list(b) for b in reference]
    retried = any("ended abruptly" in str(w.message) for w in caught)
    # Dask recomputes by itself a result lost with its worker when the kill lands just after
    # the task ended (its scheduler still listed it): then no chunk of the Loader's was lost
    assert retried or cluster != "ray", [str(w.message) for w in caught]


def test_samples_that_kill_workers_twice_are_named_and_not_sent_again(
    cluster: Any, local_paths: list[str]
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=die_on_five, batch_size=4,
                              executor=cluster, on_error="skip")
    with loader, pytest.warns(RuntimeWarning, match="ended abruptly"):
        seen = [int(i) for batch in loader for i in batch]
    assert seen == [i for i in range(SAMPLE_COUNT) if i not in (4, 5, 6, 7)]


def test_close_leaves_a_given_cluster_as_it_found_it(cluster: Any, local_paths: list[str]
                                                     ) -> None:
    if cluster == "ray":
        import ray

        run(local_paths, executor=cluster, decode=index_of)
        assert ray.is_initialized()  # still connected: the cluster was given
        assert wait_until(lambda: not worker_pids(cluster), 30)  # the actors are gone
        return
    workers = worker_pids(cluster)
    run(local_paths, executor=cluster, decode=index_of)
    assert worker_pids(cluster) == workers
    assert not any(keys for keys in cluster.has_what().values())  # no result left


def test_dask_batches_come_from_their_workers_not_relayed_by_the_scheduler(
    dask_client: Any, local_paths: list[str]
) -> None:
    """Dask's default gathers a result through the scheduler: every batch copied twice."""
    scheduler = dask_client.cluster.scheduler
    gather = scheduler.handlers["gather"]
    relayed: list[Any] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        relayed.append(kwargs.get("keys"))
        return gather(*args, **kwargs)

    scheduler.handlers["gather"] = counted
    try:
        got = run(local_paths, executor=dask_client, num_workers=2)
    finally:
        scheduler.handlers["gather"] = gather
    assert_same_batches(got, run(local_paths, num_workers=2))
    assert relayed == []


def test_an_executor_of_another_kind_is_refused_naming_what_works(local_paths: list[str]) -> None:
    with pytest.raises(ValueError, match=r"concurrent\.futures\.Executor, a Dask"):
        aioloader.Loader(aioloader.Files(local_paths), executor="spark")


def test_tasks_no_executor_can_stop_end_in_a_stall_error_not_a_hang(
    local_paths: list[str],
) -> None:
    """Both threads blocked past their deadline: the chunks left wait for a free worker, and
    the watchdog names the two being freed."""
    with ThreadPoolExecutor(2) as executor:
        loader = aioloader.Loader(aioloader.Files(local_paths), decode=blocked_on_five_and_nine,
                                  batch_size=4, decode_timeout=0.5, on_error="skip",
                                  stall_timeout=2, executor=executor)
        try:
            with pytest.raises(aioloader.StallError, match="being freed"), loader:
                list(loader)
        finally:
            RELEASE.set()


def test_a_plain_executor_keeps_the_deadline(local_paths: list[str]) -> None:
    with ThreadPoolExecutor(2) as executor:
        loader = aioloader.Loader(aioloader.Files(local_paths), decode=stuck_on_five_a_while,
                                  batch_size=4, decode_timeout=1, on_error="skip",
                                  executor=executor)
        with loader:
            seen = [int(i) for batch in loader for i in batch]
    assert seen == [i for i in range(SAMPLE_COUNT) if i not in (4, 5, 6, 7)]


POOL_DECODED: list[int] = []


def decoded_while_the_consumer_stops(paths: list[str], folder: Path,
                                     memory_limit: int | None, **options: Any) -> int:
    """Samples decoded (2 MiB each) by the time the consumer, having taken two batches, has
    stopped for 3 s."""
    folder.mkdir()
    files = aioloader.Files(paths, labels=[str(folder)] * len(paths))
    loader = aioloader.Loader(files, decode=two_megabytes_marked, batch_size=4, prefetch=1,
                              num_workers=2, memory_limit=memory_limit, **options)
    with loader:
        for n, _ in enumerate(loader):
            if n == 1:
                time.sleep(3)
                return len(list(folder.iterdir()))
    raise AssertionError("the pass ended early")


def test_chunks_out_on_the_cluster_count_against_memory_limit_as_in_the_pool(
    cluster: Any, local_paths: list[str], tmp_path: Path
) -> None:
    limit = 24 << 20  # three chunks of 8 MiB
    if not POOL_DECODED:  # the built-in pool's figure, measured once for both clusters
        POOL_DECODED.append(decoded_while_the_consumer_stops(local_paths, tmp_path / "pool",
                                                             limit, service=None))
    pool = POOL_DECODED[0]
    bounded = decoded_while_the_consumer_stops(local_paths, tmp_path / "a", limit,
                                               executor=cluster)
    unbounded = decoded_while_the_consumer_stops(local_paths, tmp_path / "b", None,
                                                 executor=cluster)
    assert bounded <= pool < unbounded
