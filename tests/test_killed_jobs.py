"""What a job killed whole leaves behind: nothing. Nobody of it is left to clean up (its zygote
dies with it: `kill -9` of the process group, as `timeout -s KILL`, Slurm and a cgroup OOM kill
do), so its shared memory must need nobody: blocks are held by descriptor, never by a name in
/dev/shm, and go with the last process that holds or maps them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from segments import blocks, names

JOB = """
import sys, time
sys.path.insert(0, {tests!r})
import aioloader
from decoders import two_megabytes
service = sys.argv[1] if sys.argv[1] != "None" else None
loader = aioloader.Loader(aioloader.Files({paths!r}), decode=two_megabytes, batch_size=4,
                          num_workers=2, service=service)
batches = iter(loader)
held = [next(batches), next(batches)]
print("running", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("service", [None, "process", "node"])
def test_a_job_killed_whole_leaves_no_shared_memory_at_once(
    service: str | None, local_paths: list[str], tmp_path: Path
) -> None:
    script = JOB.format(tests=str(Path(__file__).parent), paths=local_paths[:32])
    names_before = names()
    job = subprocess.Popen([sys.executable, "-c", script, str(service)], stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert job.stdout is not None
        assert job.stdout.readline().strip() == "running"
        tree = {job.pid, *(p.pid for p in psutil.Process(job.pid).children(recursive=True))}
        made = set(blocks(tree))
        assert made, "no shared block in use: the test no longer shows what a kill leaves"
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) and not _zombie(pid) for pid in tree):
            assert time.monotonic() < deadline, "the job's processes outlived its SIGKILL"
            time.sleep(0.05)
        deadline = time.monotonic() + 10  # a node's service ends on its own when its ranks do
        while (left := made & set(blocks())) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"service={service}: {len(made)} blocks in use, {len(left)} left after the kill")
        assert not left
        assert names() == names_before  # and no name in /dev/shm, then or now
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
