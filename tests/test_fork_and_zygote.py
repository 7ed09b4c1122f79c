"""A child made with `os.fork()` leaves its parent's loader alone; the zygote's control protocol
stays in step after a late reply; nothing is left unclosed under `python -X dev`; the one
framing carries descriptors and large bodies; decode timeouts are reported; the leak check
sees Unix sockets."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import aioloader
from aioloader._ipc.channel import Channel
from aioloader._ipc.messages import Chunk
from aioloader._processes import zygote
from aioloader._processes.pool import DecodePool
from aioloader._scheduling.decoders import PoolDecoder, Recovery
from aioloader._worker.decode import DecodeSpec

from conftest import snapshot
from decoders import index_and_noise, sample_bytes, stuck_on_five

TESTS = Path(__file__).resolve().parent
PACKAGE_PARENT = str(TESTS.parent)
RUN_SECONDS = 90
"""The longest a script may run; each takes a few seconds."""


def run_script(code: str, *options: str, environment: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(environment or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *options, "-c", code], capture_output=True,
                          text=True, env=env, timeout=RUN_SECONDS, check=False)


# -- a forked child and its parent's loader ------------------------------------------------------

FORK_SCRIPT = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import psutil
import aioloader
from decoders import big_image, index_and_noise
from segments import held

def decode(raw, rng):  # index_and_noise, with an image big enough for shared memory
    return {{**index_and_noise(raw, rng), "image": big_image(raw)}}

def wait_for(pid):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    return "did not end"

def segments():  # the blocks this process holds: a child's exit or close must not end them
    return set(held([os.getpid()]))

def decode_processes():
    return sorted(p.pid for z in psutil.Process().children()
                  if "zygote_main" in " ".join(z.cmdline()) for p in z.children()
                  if p.name() == "aioloader-dec")

loader = aioloader.Loader(aioloader.Files({paths!r}), decode=decode, batch_size=4,
                          shuffle=True, seed=7, persistent_workers=True,
                          max_worker_restarts=0, stall_timeout=20, service={service!r})
mode = {mode!r}

def fork_here():
    before, processes = segments(), decode_processes()
    if mode == "mid-epoch, lock held":
        loader._factory.blocks._lock.acquire()  # as the loader's thread may hold it at the fork
    pid = os.fork()
    if pid == 0:
        if mode == "iterate":
            try:
                next(iter(loader))
                print(json.dumps({{"child": "got a batch"}}), flush=True)
            except aioloader.LoaderError as e:
                print(json.dumps({{"child": str(e)}}), flush=True)
        if mode == "mid-epoch":  # as a child dropping what it inherited would
            batches.close()
            print(json.dumps({{"child stats": loader.stats.batches}}), flush=True)
        if mode == "os._exit":
            os._exit(0)
        sys.exit(0)
    if mode == "mid-epoch, lock held":
        loader._factory.blocks._lock.release()
    print(json.dumps({{"child exit code": wait_for(pid),
                      "segments removed": sorted(before - segments())}}), flush=True)
    return processes

if mode.startswith("mid-epoch"):
    batches = iter(loader)
    got = [next(batches) for _ in range(3)]
    processes = fork_here()
    got += list(batches)
else:  # between passes, the decode processes kept
    kept = list(loader)  # the child has views of the parent's blocks too
    if mode == "iterate":
        kept.clear()  # the blocks are free: the child's pass may lease one
    processes = fork_here()
    got = list(loader)
print(json.dumps({{"epoch": loader.epoch - 1, "index": [b["index"].tolist() for b in got],
                  "noise": [b["noise"].tolist() for b in got],
                  "images right": all((b["image"][:, 0, 0, 0] == b["index"]).all()
                                      for b in got),
                  "through shared memory": loader.stats.transport["shared"],
                  "same decode processes": decode_processes() == processes}}), flush=True)
loader.close()
"""


def run_fork_script(local_paths: list[str], mode: str) -> dict[str, Any]:
    """What the script printed, and under "stderr" what it wrote there."""
    # the lock a thread of the loader may hold is the in-process pass's: the service's client
    # holds none across the fork
    service = None if mode == "mid-epoch, lock held" else "process"
    result = run_script(FORK_SCRIPT.format(tests=str(TESTS), paths=local_paths, mode=mode,
                                           service=service))
    report: dict[str, Any] = {"stderr": result.stderr[-3000:]}
    for line in result.stdout.splitlines():
        report.update(json.loads(line))
    return report


def assert_right_epoch(local_paths: list[str], report: dict[str, Any]) -> None:
    """The parent's pass after the fork ran to its end, handing over the batches of an epoch
    decoded inline."""
    assert "index" in report, report["stderr"]
    assert report["images right"]
    assert report["through shared memory"] > 0  # the parent's blocks were in play
    with aioloader.Loader(aioloader.Files(local_paths), decode=index_and_noise, batch_size=4,
                          shuffle=True, seed=7, num_workers=0) as reference:
        reference.set_epoch(report["epoch"])
        expected = list(reference)
    assert [b["index"].tolist() for b in expected] == report["index"]
    for theirs, mine in zip(expected, report["noise"], strict=True):
        np.testing.assert_array_equal(theirs["noise"], np.asarray(mine, np.float32))


@pytest.mark.parametrize("mode", ["sys.exit", "os._exit"])
def test_a_forked_child_that_exits_leaves_the_parents_decode_processes_and_blocks_alone(
    local_paths: list[str], mode: str
) -> None:
    report = run_fork_script(local_paths, mode)
    assert report["child exit code"] == 0
    assert report["segments removed"] == []
    assert report["same decode processes"]
    assert_right_epoch(local_paths, report)


def test_a_forked_child_iterating_the_parents_loader_gets_an_error_naming_the_fork(
    local_paths: list[str],
) -> None:
    report = run_fork_script(local_paths, "iterate")
    assert "child forked from it" in report.get("child", ""), report
    assert "Build a new Loader in the child" in report["child"]


def test_a_forked_childs_failed_pass_leaves_the_parents_shared_memory_and_next_epoch_alone(
    local_paths: list[str],
) -> None:
    report = run_fork_script(local_paths, "iterate")
    assert report["segments removed"] == []
    assert_right_epoch(local_paths, report)


def test_a_child_forked_mid_epoch_exits_even_if_a_loader_thread_held_a_lock(
    local_paths: list[str],
) -> None:
    report = run_fork_script(local_paths, "mid-epoch, lock held")
    assert report["child exit code"] == 0
    assert report["same decode processes"]
    assert_right_epoch(local_paths, report)


# -- the zygote's control protocol ---------------------------------------------------------------


def test_a_child_forked_mid_epoch_leaves_the_parents_served_pass_alone(
    local_paths: list[str],
) -> None:
    """The child's exit closes the iterator it inherited: that must not stop the parent's pass
    in the loader service, nor read the parent's batches off the socket."""
    report = run_fork_script(local_paths, "mid-epoch")
    assert report["child exit code"] == 0, report["stderr"]
    assert_right_epoch(local_paths, report)


def test_a_late_zygote_reply_is_not_taken_for_the_answer_to_the_next_request(
    monkeypatch: pytest.MonkeyPatch, leak_check: None
) -> None:
    monkeypatch.setattr(zygote, "REPLY_TIMEOUT", 0.5)
    helper = zygote.Zygote()  # a zygote of this test's own, not the interpreter's
    try:
        os.kill(helper.pid, signal.SIGSTOP)
        try:
            with pytest.raises(aioloader.LoaderError):
                helper.exit_status(os.getpid())  # its reply comes once the zygote runs again
        finally:
            os.kill(helper.pid, signal.SIGCONT)
        ours, theirs = socket.socketpair()
        with ours:
            with theirs:
                pid = helper.spawn(theirs)
            assert pid in [p.pid for p in psutil.Process(helper.pid).children()]
        # the decode process sees its channel end before any Init, and exits with 0
        assert helper.exit_status(pid, wait=30) == 0
    finally:
        helper._channel.close()  # the zygote sees the end of its control socket and exits
        helper._process.wait(30)


# -- python -X dev -------------------------------------------------------------------------------

ZYGOTE_DEV_SCRIPT = """
import os, signal, time
from aioloader._processes.zygote import Zygote

first = Zygote.get()
first.preload([])
os.kill(first.pid, signal.SIGKILL)
deadline = time.monotonic() + 30
while first.alive() and time.monotonic() < deadline:
    time.sleep(0.01)
Zygote.get().preload([])  # a new zygote in place of the dead one
"""


def test_the_zygote_and_its_client_leave_no_socket_unclosed_under_dev_mode() -> None:
    result = run_script(ZYGOTE_DEV_SCRIPT, "-X", "dev", "-W", "error::ResourceWarning",
                        environment={"PYTHONDEVMODE": "1"})  # the zygote runs in dev mode too
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-3000:]


LOADER_DEV_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import aioloader
from decoders import index_of

with aioloader.Loader(aioloader.Files({paths!r}), decode=index_of, batch_size=8,
                      num_workers=2) as loader:
    assert sum(len(batch) for batch in loader) == {count}
"""


def test_a_loader_run_under_dev_mode_leaves_nothing_unclosed(local_paths: list[str]) -> None:
    code = LOADER_DEV_SCRIPT.format(tests=str(TESTS), paths=local_paths, count=len(local_paths))
    result = run_script(code, "-X", "dev", "-W", "error::ResourceWarning")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ResourceWarning" not in result.stderr, result.stderr[-3000:]


# -- the framing ---------------------------------------------------------------------------------


def test_a_channel_message_carries_descriptors_and_a_body_larger_than_the_socket_buffer(
) -> None:
    left, right = socket.socketpair()
    read_end, write_end = os.pipe()
    body = bytes(range(256)) * 40_000  # 10 MB: sent in many pieces
    sender = threading.Thread(target=Channel(left).send, args=(("body", body), [write_end]))
    try:
        sender.start()
        (kind, received), fds = Channel(right).receive_with_fds()
        sender.join(30)
        assert (kind, received) == ("body", body)
        assert len(fds) == 1
        os.write(fds[0], b"x")  # the descriptor received is the pipe's write end
        assert os.read(read_end, 1) == b"x"
        os.close(fds[0])
    finally:
        for descriptor in (read_end, write_end):
            os.close(descriptor)
        left.close()
        right.close()


def test_a_message_of_more_parts_than_one_call_takes_arrives_whole() -> None:
    """`dumps_data` keeps each large payload as its own part; a message of many (here 1,300
    parts, past the kernel's 1,024 buffers per call) goes in several calls, none lost."""
    from aioloader._ipc.channel import dumps_data

    left, right = socket.socketpair()
    samples = [bytes([n % 256]) * 65_536 for n in range(1_300)]
    parts = dumps_data(samples)
    assert len(parts) > 1_024
    sender = threading.Thread(target=Channel(left).send_bytes, args=(parts,))
    try:
        sender.start()
        assert Channel(right).receive() == samples
        sender.join(30)
    finally:
        left.close()
        right.close()


# -- decode timeouts reach their observer --------------------------------------------------------


async def test_a_decode_timeout_is_reported_to_the_passes_observer(leak_check: None) -> None:
    spec = DecodeSpec(stuck_on_five, None, True, 0)
    timeouts: list[None] = []
    decoder = PoolDecoder(lambda: DecodePool(spec, 1, 0, None), True,
                          Recovery(0.5, 3, True, on_restart=lambda message: None,
                                   on_timeout=lambda: timeouts.append(None)))
    try:
        result = await asyncio.wait_for(decoder.decode(Chunk(0, [5], [sample_bytes(5)])), 60)
    finally:
        await decoder.aclose()
    assert "decode_timeout" in result.skipped[0][1]
    assert len(timeouts) == 1


# -- the leak check ------------------------------------------------------------------------------


def test_the_leak_check_counts_unix_sockets() -> None:
    before = snapshot()
    left, right = socket.socketpair()
    with left, right:
        assert snapshot().unix_sockets == before.unix_sockets + 2



FORK_STORM_SCRIPT = """
import os, signal, subprocess, sys, threading, time
sys.path.insert(0, {tests!r})
import aioloader
from decoders import index_of

fork_exec = subprocess._fork_exec

def slow_fork_exec(*args):  # widen the window in which Popen's pipe is open
    time.sleep(0.5)
    return fork_exec(*args)

subprocess._fork_exec = slow_fork_exec
children = []

def fork_storm():
    for _ in range(100):  # children that outlive the zygote's start, as long-lived workers do
        time.sleep(0.01)
        pid = os.fork()
        if pid == 0:  # lives as long as the script does
            parent = os.getppid()
            while os.getppid() == parent:
                time.sleep(0.1)
            os._exit(0)
        children.append(pid)

storm = threading.Thread(target=fork_storm)
storm.start()
loader = aioloader.Loader(aioloader.Files({paths!r}), decode=index_of, batch_size=10)
storm.join()
signal.alarm(20)  # a hang ends the script (and the children with it) instead of the test run
try:
    print(sum(len(batch) for batch in loader), flush=True)
finally:
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    loader.close()
"""


def test_children_forked_while_the_zygote_starts_do_not_hang_it(local_paths: list[str]) -> None:
    """A child forked while the zygote's Popen runs would hold Popen's pipe open, and Popen,
    with every decode process of the interpreter, would wait until the child exits."""
    result = run_script(FORK_STORM_SCRIPT.format(tests=str(TESTS), paths=local_paths[:30]))
    assert result.stdout.strip() == "30", result.stderr[-2000:]


def test_private_modules_decode_processes_import_are_not_preloaded_on_their_own() -> None:
    """`_asyncio` imported before `asyncio` (as a preload of what a decode process imported
    would) leaves `asyncio.current_task()` None in every process forked after: aiohttp then
    fails every read of a loader service with "Timeout context manager should be used inside a
    task"."""
    from aioloader._worker.preload import installed_packages

    assert installed_packages({"_asyncio", "asyncio", "_socket"}) == ["asyncio"]
    script = ("from aioloader._worker.preload import preload\n"
              "preload(['_asyncio', 'asyncio'])\n"
              "import asyncio\n"
              "async def current():\n"
              "    return asyncio.current_task()\n"
              "print(asyncio.run(current()) is not None)\n")
    assert run_script(script).stdout.strip() == "True"
