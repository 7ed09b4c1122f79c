"""The Ray a Loader starts (`executor="ray"`, no Ray in the process, no RAY_ADDRESS) lives as
long as the Loader and no longer, and a Loader never dies with a Ray instance. Each test runs a
fresh interpreter (Ray may end the process it runs in) on real local Ray instances, and tells
their processes by pid: Ray's daemons are not the interpreter's children once their parent
ends."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

# not imported here: test_clusters.py's fixture sets what Ray reads when it is imported
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray")

PRELUDE = '''
import json, os, signal, subprocess, sys, time
import psutil, ray, aioloader

def running(process):
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

def held():
    """The Ray instance this process holds, read while it runs: its session folder, its GCS
    address, its head processes (Ray's node knows them) and every process under them or whose
    command line names the session."""
    node = ray._private.worker._global_node
    session = node.get_session_dir_path()
    name = os.path.basename(session)
    heads = {kind: infos[0].process.pid for kind, infos in node.all_processes.items()}
    processes = {psutil.Process(pid) for pid in heads.values()}
    for head in list(processes):
        processes.update(head.children(recursive=True))
    processes.update(p for p in psutil.process_iter(["cmdline"])
                     if name in " ".join(p.info["cmdline"] or []))
    return {"session": session, "address": node.gcs_address, "heads": heads,
            "processes": processes}

def heads_alive(instance):
    return all(running(psutil.Process(pid)) for pid in instance["heads"].values())

def after_close(instance):
    """What is left of the instance: its processes still running (by pid and start time, and
    any naming its session), its session folder, and what `ps` shows of its pids."""
    name = os.path.basename(instance["session"])
    left = sorted(p.pid for p in instance["processes"] if running(p))
    left += [p.pid for p in psutil.process_iter(["cmdline"])
             if name in " ".join(p.info["cmdline"] or []) and running(p)]
    pids = ",".join(str(p.pid) for p in sorted(instance["processes"], key=lambda p: p.pid))
    shown = subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-p", pids],
                           capture_output=True, text=True).stdout
    return {"left": left, "session_exists": os.path.exists(instance["session"]), "ps": shown,
            "pids": pids, "address": instance["address"], "session": instance["session"]}

def closed(loader, instance):
    began = time.monotonic()
    loader.close()
    return {**after_close(instance), "close_seconds": time.monotonic() - began,
            "initialized": ray.is_initialized()}

def report(**result):
    print("RESULT " + json.dumps(result), flush=True)
'''


def environment(**extra: str) -> dict[str, str]:
    """No RAY_ADDRESS (the Loader would use that cluster); Ray on loopback."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def result_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def run_script(body: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True,
                          text=True, timeout=100, env=env or environment())
    return result_of(done)


def assert_gone(closing: dict[str, Any]) -> None:
    print(f"after close() ({closing['close_seconds']:.1f} s), ps -p {closing['pids']}:\n"
          f"{closing['ps']}")
    assert closing["left"] == [], closing["ps"]
    assert not closing["session_exists"]
    assert closing["close_seconds"] < 30


def test_a_ray_the_loader_started_is_stopped_when_it_closes(local_paths: list[str]) -> None:
    """Its head lives until close() (started from a short-lived thread, Linux killed it when
    that thread ended); after close() returns, none of its processes runs, found by pid, and
    its session folder is gone."""
    result = run_script(f"""
paths = {local_paths[:8]!r}
loader = aioloader.Loader(aioloader.Files(paths), decode=len, batch_size=4, executor="ray",
                          num_workers=1)
got = sorted(int(n) for batch in loader for n in batch)
time.sleep(1)  # the thread that ran the first pass's blocking calls has ended
instance = held()
report(got=got, expected=sorted(os.path.getsize(p) for p in paths),
       alive=heads_alive(instance), closing=closed(loader, instance))
""")
    assert result["got"] == result["expected"]
    assert result["alive"]
    assert not result["closing"]["initialized"]
    assert_gone(result["closing"])


def test_a_second_ray_loader_right_after_the_first_closes_has_a_ray_of_its_own(
    local_paths: list[str],
) -> None:
    """The second Loader (with a decode_timeout, as when Ray ended the process) starts its own
    instance once the first is gone, and it lives until its own close()."""
    result = run_script(f"""
paths = {local_paths[:8]!r}
runs = []
for options in ({{}}, {{"decode_timeout": 30}}):
    loader = aioloader.Loader(aioloader.Files(paths), decode=len, batch_size=4,
                              executor="ray", num_workers=1, **options)
    got = sorted(int(n) for batch in loader for n in batch)
    time.sleep(1)
    instance = held()
    runs.append({{"got": got, "alive": heads_alive(instance),
                 "closing": closed(loader, instance)}})
report(runs=runs, expected=sorted(os.path.getsize(p) for p in paths),
       first_session_back=os.path.exists(runs[0]["closing"]["session"]))
""")
    first, second = result["runs"]
    assert first["got"] == result["expected"] and first["alive"]
    assert_gone(first["closing"])
    assert not result["first_session_back"]  # Ray kept the first's folders in the config given
    assert second["got"] == result["expected"] and second["alive"]
    assert second["closing"]["session"] != first["closing"]["session"]
    assert_gone(second["closing"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def end(processes: list[psutil.Process]) -> list[psutil.Process]:
    """SIGTERM, 2 s, then SIGKILL, 5 s (Ray's agents may take their time); those still
    running."""
    for number, wait in ((signal.SIGTERM, 2), (signal.SIGKILL, 5)):
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.send_signal(number)
        _, processes = psutil.wait_procs(processes, timeout=wait)
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_for(path: Path, seconds: float, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            out, err = process.communicate(timeout=10)
            pytest.fail(f"{path.name} did not appear:\n{(out or '')[-2000:]}\n{err[-3000:]}")
        time.sleep(0.1)


@dataclass
class OtherRay:
    """Another program's Ray: `ray start --head`, which leaves its address where a plain
    `ray.init()` looks (under RAY_TMPDIR, here a folder of the test's own); `env` sets that
    folder."""

    folder: Path
    env: dict[str, str]
    address: str
    processes: list[psutil.Process]


@pytest.fixture
def another_programs_ray() -> Iterator[OtherRay]:
    folder = Path(tempfile.mkdtemp(prefix="ray"))  # short: Ray's socket paths live under it
    env = environment(RAY_TMPDIR=str(folder), RAY_AUTH_MODE="disabled")  # no token to pass
    other = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port=0",
         "--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats",
         f"--dashboard-agent-listen-port={free_port()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    processes: list[psutil.Process] = []
    try:
        address_file = folder / "ray" / "ray_current_cluster"
        wait_for(address_file, 60, other)
        processes = tree(other.pid)
        yield OtherRay(folder, env, address_file.read_text().strip(), processes)
    finally:
        end([*processes, *(tree(other.pid) if other.poll() is None else [])])
        other.communicate(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


def heads_of(other: OtherRay) -> list[psutil.Process]:
    return [p for p in other.processes if p.name() in ("gcs_server", "raylet")]


def test_a_loader_keeps_working_when_another_programs_ray_stops(
    another_programs_ray: OtherRay, local_paths: list[str]
) -> None:
    """Another program's Ray runs while a Loader starts (a plain `ray.init()` would join it),
    then stops mid-run: the Loader uses an instance of its own, and reads on."""
    other = another_programs_ray
    ready, go = other.folder / "ready", other.folder / "go"
    loader = subprocess.Popen([sys.executable, "-c", PRELUDE + f"""
from ray._private.services import canonicalize_bootstrap_address
found = canonicalize_bootstrap_address(None)  # where a plain ray.init() would go
paths = {local_paths[:8]!r}
loader = aioloader.Loader(aioloader.Files(paths), decode=len, batch_size=4, executor="ray",
                          num_workers=1)
first = sorted(int(n) for batch in loader for n in batch)
open({str(ready)!r}, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
    time.sleep(0.1)
second = sorted(int(n) for batch in loader for n in batch)
instance = held()
report(found=found, first=first, second=second, alive=heads_alive(instance),
       expected=sorted(os.path.getsize(p) for p in paths), closing=closed(loader, instance))
"""], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=other.env)
    try:
        wait_for(ready, 60, loader)
        assert len(heads_of(other)) == 2
        assert end(other.processes) == []  # the other program's Ray has stopped
        go.touch()
        out, err = loader.communicate(timeout=60)
    finally:
        if loader.poll() is None:
            loader.kill()
            loader.communicate(timeout=10)
    result = result_of(subprocess.CompletedProcess(loader.args, loader.returncode, out, err))
    assert result["found"] == other.address  # the trap was set: Ray's own search finds it
    assert result["closing"]["address"] != other.address
    assert result["first"] == result["second"] == result["expected"] and result["alive"]
    assert_gone(result["closing"])


def test_ray_address_names_the_cluster_a_loader_uses_close_leaves_it_and_losing_it_raises(
    another_programs_ray: OtherRay, local_paths: list[str]
) -> None:
    """A Loader connects to the cluster RAY_ADDRESS names, and close() only disconnects; a
    second one, whose cluster's GCS is killed mid-epoch, raises a LoaderError naming it."""
    other = another_programs_ray
    heads = {p.name(): p.pid for p in heads_of(other)}
    result = run_script(f"""
paths = {local_paths[:8]!r}
loader = aioloader.Loader(aioloader.Files(paths), decode=len, batch_size=4, executor="ray",
                          num_workers=1)
got = sorted(int(n) for batch in loader for n in batch)
address = ray._private.worker._global_node.gcs_address
loader.close()
initialized = ray.is_initialized()
left_running = all(running(psutil.Process(pid)) for pid in {sorted(heads.values())!r})

def slow(raw):
    time.sleep(0.05)
    return len(raw)

loader = aioloader.Loader(aioloader.Files(paths * 10), decode=slow, batch_size=4,
                          executor="ray", num_workers=1, stall_timeout=20)
error, batches = None, 0
try:
    for batch in loader:
        batches += 1
        if batches == 2:
            os.kill({heads["gcs_server"]}, signal.SIGKILL)
            killed = time.monotonic()
except aioloader.LoaderError as e:
    error = {{"kind": type(e).__name__, "message": str(e),
             "seconds": time.monotonic() - killed}}
began = time.monotonic()
loader.close()
report(got=got, expected=sorted(os.path.getsize(p) for p in paths), address=address,
       initialized=initialized, left_running=left_running, error=error, batches=batches,
       close_seconds=time.monotonic() - began)
""", env={**other.env, "RAY_ADDRESS": other.address})
    assert result["got"] == result["expected"]
    assert result["address"] == other.address
    assert not result["initialized"] and result["left_running"]  # disconnected, no more
    error = result["error"]
    print(error, f"close() took {result['close_seconds']:.1f} s")
    assert error is not None, f"the pass ended: {result['batches']} batches"
    assert error["kind"] == "LoaderError"
    assert error["message"] == (f"the Ray instance at {other.address} was lost: its GCS refuses "
                                "connections")
    assert error["seconds"] < 10
    assert result["close_seconds"] < 30


@pytest.mark.parametrize("head", ["gcs_server", "raylet"])
def test_killing_the_ray_head_mid_epoch_is_a_loader_error_not_a_process_exit(
    head: str, local_paths: list[str]
) -> None:
    """Ray would end the process once its GCS has been gone a while; the Loader checks that
    its instance is there while it waits on Ray, and raises a LoaderError naming it, well
    within stall_timeout. close() still leaves nothing, and the process lives on."""
    stall_timeout = 20
    result = run_script(f"""
def slow(raw):
    time.sleep(0.05)
    return len(raw)

paths = {local_paths!r} * 3
loader = aioloader.Loader(aioloader.Files(paths), decode=slow, batch_size=4, executor="ray",
                          num_workers=1, stall_timeout={stall_timeout})
batches, error, killed = 0, None, None
try:
    for batch in loader:
        batches += 1
        if batches == 2:
            instance = held()
            os.kill(instance["heads"][{head!r}], signal.SIGKILL)
            killed = time.monotonic()
except aioloader.LoaderError as e:
    error = {{"kind": type(e).__name__, "message": str(e),
             "seconds": time.monotonic() - killed}}
closing = closed(loader, instance)
time.sleep(1)
report(batches=batches, error=error, closing=closing, alive=True)
""")
    error = result["error"]
    assert error is not None, f"the pass ended: {result['batches']} batches"
    print(error)
    assert error["kind"] == "LoaderError"  # not a StallError: found by the check
    assert re.match(rf"the Ray instance at \S+:\d+ that a Loader started was lost: its {head} "
                    r"\(pid \d+\) ended \(killed by SIGKILL\)", error["message"]), error
    assert error["seconds"] < stall_timeout / 2
    assert result["batches"] < len(local_paths) * 3 // 4
    assert_gone(result["closing"])
