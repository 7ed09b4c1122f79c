"""What a job killed whole leaves in /dev/shm: nobody of it is left to remove its segments (the
zygote died with it: `kill -9` of the process group, as `timeout -s KILL`, Slurm and a cgroup
OOM kill do), so the next Loader of the same user removes the segments of processes that are
gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import aioloader

from decoders import index_of

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


def _segments_of(pids: set[int]) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm")
                  if any(name.startswith(f"aioloader-{pid}-") for pid in pids))


@pytest.mark.parametrize("service", [None, "process"])
def test_segments_of_a_job_killed_whole_are_swept_by_the_next_loader(
    service: str | None, local_paths: list[str], tmp_path: Path
) -> None:
    script = JOB.format(tests=str(Path(__file__).parent), paths=local_paths[:32])
    job = subprocess.Popen([sys.executable, "-c", script, str(service)], stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert job.stdout is not None
        assert job.stdout.readline().strip() == "running"
        tree = {job.pid, *(p.pid for p in psutil.Process(job.pid).children(recursive=True))}
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) and not _zombie(pid) for pid in tree):
            assert time.monotonic() < deadline, "the job's processes outlived its SIGKILL"
            time.sleep(0.05)
        left = _segments_of(tree)
        print(f"service={service}: the killed job left {len(left)} segments")
        assert left, "nothing was left to sweep: the test no longer kills the job whole"
        with aioloader.Loader(aioloader.Files(local_paths[:8]), decode=index_of, batch_size=4,
                              num_workers=1, service=service):  # type: ignore[arg-type]
            deadline = time.monotonic() + 20
            while _segments_of(tree) and time.monotonic() < deadline:
                time.sleep(0.05)
        assert _segments_of(tree) == []
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
