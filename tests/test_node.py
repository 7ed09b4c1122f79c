"""One loader service for every rank of a node (`service="node"`).

Ranks are Loaders in this process and in processes of their own, as torchrun's environment
names them; each compares what it gets with the Loader in the caller's process
(`service=None`) and checks what is shared, what is refused, and what is left behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from segments import blocks, is_held
from test_service import _epochs, _plain, wait_until_gone

import aioloader
from aioloader._ipc.channel import Channel
from aioloader._ipc.messages import Chunk, Environment
from aioloader._processes.pool import DecodePool
from aioloader._scheduling.decoders import PoolDecoder, Recovery
from aioloader._service import rendezvous as node
from aioloader._service.messages import Failed, ServiceInit
from aioloader._worker.decode import DecodeSpec

from decoders import big_image, fail_on_seven, index_and_noise, stuck_on_five

RANKS = 2


@pytest.fixture(autouse=True)
def job(monkeypatch: pytest.MonkeyPatch) -> str:
    """A job of its own for each test, as torchrun would name it (ranks started here inherit
    it), so no test meets another's service."""
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(RANKS))
    return run_id


def _ranks(urls: list[str], service: str | None, **settings: Any) -> list[aioloader.Loader]:
    options: dict[str, Any] = dict(decode=index_and_noise, batch_size=8, shuffle=True, seed=5,
                                   num_workers=2, service=service)
    options.update(settings)
    return [aioloader.Loader(aioloader.Files(urls), rank=rank, world_size=RANKS, **options)
            for rank in range(RANKS)]


def _side_by_side(loaders: list[aioloader.Loader], epochs: int = 2) -> list[list[Any]]:
    """Each rank's batches, epoch by epoch, taken in turns as DDP's steps take them."""
    seen: list[list[Any]] = [[] for _ in loaders]
    for epoch in range(epochs):
        for loader in loaders:
            loader.set_epoch(epoch)
        for batches in zip(*loaders, strict=True):
            for rank, batch in enumerate(batches):
                seen[rank].append(_plain(batch))
    return seen


def _service_pid(loader: aioloader.Loader) -> int:
    client = loader._service._client
    assert client is not None
    return client.pid


def _wait_gone(pid: int, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.05)
    pytest.fail(f"the node's loader service (pid {pid}) still runs {seconds:g} s later")


def test_every_rank_gets_the_batches_its_own_loader_gives_from_one_service(
    urls: list[str], leak_check: None
) -> None:
    alone = _ranks(urls, None)
    expected = _side_by_side(alone)
    for loader in alone:
        loader.close()
    served = _ranks(urls, "node")
    try:
        assert _side_by_side(served) == expected
        pids = {_service_pid(loader) for loader in served}
        assert len(pids) == 1, "the ranks were served by more than one service"
        assert pids != {os.getpid()}
        made = set(blocks(pids))
        assert made
        for loader in served:  # each rank's wait is its own
            assert loader.stats.batches == len(expected[0])
            assert loader.stats.consumer_wait.count == len(expected[0])
    finally:
        for loader in served:
            loader.close()
    (pid,) = pids
    _wait_gone(pid)
    assert not made & set(blocks())  # nobody maps them any more


def test_a_node_rank_resumes_breaks_and_raises_as_its_own_loader_does(urls: list[str]) -> None:
    ranks = _ranks(urls, "node")
    try:
        first = ranks[0]
        for n, _ in enumerate(first):
            if n == 2:
                state = first.state_dict()
                break
        first.load_state_dict(state)  # a break, then a resumed pass
        rest = [_plain(batch) for batch in first]
        with aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=8,
                              shuffle=True, seed=5, rank=0, world_size=RANKS,
                              service=None) as alone:
            alone.load_state_dict(state)
            assert rest == [_plain(batch) for batch in alone]
        assert [_plain(batch) for batch in ranks[1]] == _epochs(ranks[1], 1)[0]
    finally:
        for loader in ranks:
            loader.close()
    outcomes = {}
    for service in (None, "node"):
        failing = _ranks(urls[:40], service, decode=fail_on_seven, shuffle=False)
        try:
            outcomes[service] = [_outcome(loader) for loader in failing]
        finally:
            for loader in failing:
                loader.close()
    assert outcomes["node"] == outcomes[None]
    assert any("sample seven is cursed" in str(outcome) for outcome in outcomes[None])


def _outcome(loader: aioloader.Loader) -> list[Any]:
    """The batches a rank got, then the error it raised, by type and message."""
    got: list[Any] = []
    try:
        for batch in loader:
            got.append(_plain(batch))
    except aioloader.LoaderError as e:
        got.append((type(e).__name__, str(e)))
    return got


def test_close_from_another_thread_stops_a_node_rank_and_spares_the_other(
    urls: list[str], leak_check: None
) -> None:
    ranks = _ranks(urls, "node", decode=stuck_on_five, batch_size=10, shuffle=False)
    with aioloader.Loader(aioloader.Files(urls), batch_size=10, rank=1, world_size=RANKS,
                          service=None) as alone:
        five_in_rank_one = any(5 in _plain(batch) for batch in alone)
    stuck, other = ranks[::-1] if five_in_rank_one else ranks
    try:
        assert len([_plain(b) for b in other]) == 5
        threading.Timer(1.0, stuck.close).start()
        with pytest.raises(aioloader.LoaderError, match="closed"):
            list(stuck)
    finally:
        stuck.close()
        other.close()


RANK = """
import json, os, signal, sys
sys.path.insert(0, {tests!r})
import aioloader
from decoders import index_and_noise
rank, die_after = {rank}, {die_after}
loader = aioloader.Loader(aioloader.Files({urls!r}), decode=index_and_noise, batch_size={batch},
                          shuffle=True, seed=5, rank=rank, world_size={world}, num_workers=2,
                          service="node")
for n, batch in enumerate(loader):
    if n == die_after:
        print("pid", loader._service._client.pid, flush=True)
        input()  # the test kills this rank here
    print(json.dumps({{"index": batch["index"].tolist(),
                       "noise": batch["noise"].tolist()}}), flush=True)
print("done", flush=True)
"""


def _rank_process(urls: list[str], rank: int, die_after: int = -1, batch: int = 8,
                  world: int = RANKS) -> subprocess.Popen[str]:
    script = RANK.format(tests=str(Path(__file__).parent), urls=urls, rank=rank,
                         die_after=die_after, batch=batch, world=world)
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _lines(process: subprocess.Popen[str]) -> Iterator[str]:
    assert process.stdout is not None
    yield from (line.strip() for line in process.stdout)


def test_a_rank_that_dies_costs_the_others_nothing_and_the_last_ends_the_service(
    urls: list[str],
) -> None:
    dying = _rank_process(urls, rank=0, die_after=3)
    survivor = _rank_process(urls, rank=1)
    try:
        lines = _lines(dying)
        while not (line := next(lines)).startswith("pid"):
            pass
        pid = int(line.split()[1])
        dying.kill()
        dying.wait(10)
        got = [json.loads(line) for line in _lines(survivor) if line != "done"]
        assert survivor.wait(60) == 0
    finally:
        for process in (dying, survivor):
            process.kill()
            process.wait(10)
    with aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=8,
                          shuffle=True, seed=5, rank=1, world_size=RANKS, service=None) as alone:
        assert got == [_plain(batch) for batch in alone]
    _wait_gone(pid)


def test_a_sigkilled_last_rank_takes_the_service_and_its_blocks_with_it(
    urls: list[str],
) -> None:
    rank = _rank_process(urls, rank=0, die_after=2, world=1)
    try:
        lines = _lines(rank)
        while not (line := next(lines)).startswith("pid"):
            pass
        pid = int(line.split()[1])
        family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        assert len(family) >= 3, "no decode processes under the node's service"
        made = set(blocks([rank.pid, *(p.pid for p in family)]))
        assert made
    finally:
        rank.send_signal(signal.SIGKILL)
        rank.wait(10)
    wait_until_gone(family, made)


def test_a_rank_with_another_configuration_gets_its_own_service_and_batches(
    urls: list[str], leak_check: None
) -> None:
    ranks = _ranks(urls, "node")
    other = aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=5,
                             shuffle=True, seed=5, rank=1, world_size=RANKS, service="node")
    try:
        got = [_plain(batch) for batch in other]
        list(ranks[0])
        assert _service_pid(other) != _service_pid(ranks[0])
    finally:
        for loader in [*ranks, other]:
            loader.close()
    with aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=5,
                          shuffle=True, seed=5, rank=1, world_size=RANKS, service=None) as alone:
        assert got == [_plain(batch) for batch in alone]


def test_a_service_refuses_a_rank_whose_fingerprint_differs(urls: list[str]) -> None:
    """Two configurations never meet at one socket; should they (a name collision), the
    service says so rather than serve one's batches to the other."""
    (rank, _) = _ranks(urls, "node")
    try:
        list(rank)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(30)
        sock.connect(_socket_of(rank))
        channel = Channel(sock)
        channel.send(ServiceInit(rank._service.code, Environment.here(), "f" * 64))
        reply = channel.receive()
        channel.close()
        assert isinstance(reply, Failed) and "another configuration" in reply.reason
    finally:
        rank.close()


def _socket_of(loader: aioloader.Loader) -> str:
    (path,) = [p for p in node.private_directory().path.glob("*.sock")
               if _listening_pid(p) == _service_pid(loader)]
    return str(path)


def _listening_pid(path: Path) -> int | None:
    """The process listening at `path`, which it bound through its folder's descriptor
    (`/proc/self/fd/N/NAME.sock`): known by the socket's name."""
    for process in psutil.process_iter():
        try:
            if any(isinstance(c.laddr, str) and c.laddr.endswith(f"/{path.name}")
                   for c in process.net_connections(kind="unix")):
                return process.pid
        except psutil.Error:
            continue
    return None


def _connect_as_nobody(path: str) -> str:
    """Connect to `path` from a forked child that became user nobody; what it met."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        os.close(read)
        outcome = "connected"
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(path)
            channel = Channel(sock)
            channel.send(ServiceInit(b"", Environment.here()))
            outcome = "reply: " + str(channel.receive())
        except BaseException as e:
            outcome = f"{type(e).__name__}: {e}"
        os.write(write, outcome.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        outcome = pipe.read()
    os.waitpid(child, 0)
    return outcome


@pytest.mark.skipif(os.getuid() != 0, reason="a second user needs root to become one")
def test_another_user_cannot_reach_or_use_a_nodes_service(urls: list[str]) -> None:
    (rank, _) = _ranks(urls, "node")
    try:
        list(rank)
        path = _socket_of(rank)
        folder = Path(path).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert _connect_as_nobody(path).startswith("PermissionError")
        folder.chmod(0o711)  # opened by mistake: the service still checks who is calling
        os.chmod(path, 0o777)
        try:
            outcome = _connect_as_nobody(path)
        finally:
            folder.chmod(0o700)
        assert outcome.startswith("reply: Failed(") and "user 65534" in outcome
        assert [_plain(batch) for batch in rank]  # the owner is still served
    finally:
        rank.close()


def test_a_folder_others_may_enter_is_passed_over_with_a_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = tmp_path / f"aioloader-{os.getuid()}"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with caplog.at_level(logging.WARNING, "aioloader"):
        found = node.private_directory()
    os.close(found.descriptor)
    assert found.path == tmp_path / f"aioloader-{os.getuid()}-1"
    assert "no one else may enter" in caplog.text


def _record_order(raw: int) -> int:
    time.sleep(0.05)
    with open(os.environ["ORDER_FILE"], "a") as order:
        order.write(f"{raw}\n")
    return raw


async def _decode_in_steps(steps: list[int]) -> None:
    spec = DecodeSpec(_record_order, None, False, 0, None, None, None, 1)
    pool = DecodePool(spec, 1, 0, None)
    decoder = PoolDecoder(lambda: pool, True, Recovery(None, 0, False, lambda _: None))
    try:
        await asyncio.gather(*(decoder.decode(Chunk(0, [step], [step], None, step))
                               for step in steps))
    finally:
        await decoder.aclose()


def test_the_decode_pool_runs_the_earliest_step_first(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Of several ranks' chunks waiting, the one of the rank furthest behind goes first."""
    order_file = tmp_path / "order"
    monkeypatch.setenv("ORDER_FILE", str(order_file))
    asyncio.run(_decode_in_steps([9, 2, 7, 0, 5, 1]))
    assert [int(line) for line in order_file.read_text().split()] == [0, 1, 2, 5, 7, 9]


def test_node_batches_are_views_of_shared_memory(urls: list[str]) -> None:
    ranks = _ranks(urls, "node", decode=big_image)
    try:
        batch = next(iter(ranks[0]))
        assert isinstance(batch, np.ndarray) and batch.base is not None
    finally:
        for loader in ranks:
            loader.close()



FINGERPRINT = """
import sys
sys.path.insert(0, {tests!r})
import aioloader
from aioloader._service.fingerprint import fingerprint


class Squares(aioloader.Dataset):
    def __init__(self):
        self.names = {{"a", "bb", "ccc", "dddd"}}
        self.paths = {paths!r}
    def __len__(self):
        return 4
    async def fetch(self, index):
        return index


files = aioloader.Files({paths!r})
loader = aioloader.Loader(Squares(), decode=lambda raw: raw + 1, rank={rank}, world_size=2,
                          service="node")
print(loader._service.fingerprint,
      fingerprint([files, Squares(), {{"x": (1, 2.5, None)}}, lambda v: v * 2]))
"""


def test_a_fingerprint_is_the_same_in_every_rank_whatever_its_hash_seed(
    local_paths: list[str],
) -> None:
    """Pickles differ from process to process (fresh ids for classes sent by value, sets in
    hash order); the fingerprint ranks meet by must not."""
    seen = set()
    for seed, rank in ((1, 0), (2, 1), (3, 1)):
        script = FINGERPRINT.format(tests=str(Path(__file__).parent), paths=local_paths[:3],
                                    rank=rank)
        seen.add(subprocess.run([sys.executable, "-c", script], check=True, timeout=60,
                                capture_output=True, text=True,
                                env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout)
    assert len(seen) == 1


def _block_of(array: np.ndarray, maps: dict[str, Any]) -> str:
    """The name of the shared block a batch's array views."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    block = base.obj if isinstance(base, memoryview) else base
    return next(name for name, mapped in maps.items() if mapped is block)


def test_blocks_a_leaving_rank_still_held_go_back_while_the_others_run(
    urls: list[str],
) -> None:
    leaving, staying = _ranks(urls, "node", decode=big_image, shuffle=False)
    try:
        kept = []
        staying_batches = iter(staying)
        for batch, _ in zip(leaving, range(3), strict=False):
            kept.append(batch)
            next(staying_batches)
        client = leaving._service._client
        assert client is not None
        names = {_block_of(batch, client._maps) for batch in kept}
        leaving.close()  # the trainer keeps its views: their memory stays, the pool's room too
        deadline = time.monotonic() + 10
        while any(map(is_held, names)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(is_held, names)), "held blocks stayed in the pool"
        assert [int(batch[0, 0, 0, 0]) for batch in kept] == [0, 16, 32]  # still readable
        assert len(list(staying_batches)) == 7 - 3  # 100 samples: 7 batches each
    finally:
        leaving.close()
        staying.close()


def test_the_job_includes_the_working_directory_and_a_missing_runtime_dir_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    here = node.job()
    monkeypatch.chdir(tmp_path)
    assert node.job() != here
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "gone"))
    assert node.private_directory().path.parent != tmp_path / "gone"


def test_fingerprints_tell_apart_repeats_and_bound_builtins() -> None:
    from aioloader._service.fingerprint import fingerprint

    a, b = [1], [2]
    assert fingerprint([a, b, a]) != fingerprint([a, b, b])
    assert fingerprint({"x": 1}.get) != fingerprint({"x": 2}.get)
    assert fingerprint({"x": 1}.get) == fingerprint({"x": 1}.get)


async def _granted_in_order(orders: list[int]) -> list[int]:
    from aioloader._pass.autotune import ReadLimit

    reads = ReadLimit(1)
    reads.try_acquire()
    granted: list[int] = []

    async def read(order: int) -> None:
        await reads.acquire(order)
        granted.append(order)
        await asyncio.sleep(0)
        reads.release()

    tasks = [asyncio.ensure_future(read(order)) for order in orders]
    await asyncio.sleep(0)
    reads.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return granted


def test_shared_reads_go_to_the_earliest_step_first() -> None:
    """Of the ranks waiting for a read slot, the one furthest behind reads first."""
    assert asyncio.run(_granted_in_order([9, 2, 7, 0, 5])) == [0, 2, 5, 7, 9]
