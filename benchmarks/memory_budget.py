"""What `memory_limit` bounds: the peak of shared memory (the machine's Shmem: the blocks, which
have no name in /dev/shm) plus the peak growth of the anonymous memory (RssAnon: heaps, not
shared pages, which Shmem counts once) of every aioloader
process (the trainer, its service, the zygote, the decode processes), for decoded samples much
larger than the raw ones, and a consumer that takes one batch at a time and holds none while
it sleeps a step.

    python benchmarks/memory_budget.py            # the whole table
    python benchmarks/memory_budget.py 50 2 128 process   # one row, as JSON (the tests use it)

Limit + 64 MiB is the goal of each row: what the limit counts, plus the interpreter's and the
allocator's own (a Python process grows by a few MiB on its first batches)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from typing import Any

import numpy as np
import psutil
from benchmarks_common import Indices

import aioloader

MiB = 2**20
ROWS = [
    (20, 4, 256, "process", 1),
    (50, 2, 128, "process", 1),
    (100, 1, 256, "process", 1),
    (50, 2, 128, None, 1),
    (8, 4, 128, "node", 3),
]
STEP_SECONDS = 0.2
BATCHES = 8


class Filled:
    """A sample of `size` bytes made from its index (raw: a few bytes)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, index: int) -> np.ndarray:
        return np.full(self.size, index % 251, np.uint8)


def shm_used() -> int:
    """The machine's shared memory in use: /dev/shm, memory files, tmpfs."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def anonymous(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0


class Peaks(threading.Thread):
    """Samples shared memory and every process of this tree every 5 ms: peak shared memory
    above where it started, peak sum of each process's RssAnon above its first sight."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.shm = self.anonymous = 0
        self._done = threading.Event()
        self._shm_base = shm_used()
        self._first: dict[int, int] = {}

    def run(self) -> None:
        me = psutil.Process()
        while not self._done.wait(0.005):
            growth = 0
            for process in [me, *me.children(recursive=True)]:
                now = anonymous(process.pid)
                if now is not None:
                    growth += max(0, now - self._first.setdefault(process.pid, now))
            self.shm = max(self.shm, shm_used() - self._shm_base)
            self.anonymous = max(self.anonymous, growth)

    def finish(self) -> None:
        self._done.set()
        self.join()


def consume(loader: aioloader.Loader, batch: int, size: int) -> int:
    taken = 0
    with loader:
        for got in loader:
            assert got.shape == (batch, size)
            del got  # holds nothing while it sleeps its step
            taken += 1
            time.sleep(STEP_SECONDS)
    return taken


def row(size_mib: int, batch: int, limit_mib: int, service: str | None,
        ranks: int = 1) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks)
    os.environ["TORCHELASTIC_RUN_ID"] = f"memory-{uuid.uuid4().hex[:8]}"
    loaders = [aioloader.Loader(Indices(BATCHES * batch * ranks), decode=Filled(size_mib * MiB),
                                batch_size=batch, num_workers=2, memory_limit=limit_mib * MiB,
                                service=service, rank=rank, world_size=ranks)
               for rank in range(ranks)]
    peaks = Peaks()
    peaks.start()
    threads = [threading.Thread(target=consume, args=(loader, batch, size_mib * MiB))
               for loader in loaders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    peaks.finish()
    return {"shm_mib": peaks.shm / MiB, "anonymous_mib": peaks.anonymous / MiB,
            "total_mib": (peaks.shm + peaks.anonymous) / MiB, "limit_mib": limit_mib}


def one_row_in_a_process(size_mib: int, batch: int, limit_mib: int, service: str | None,
                         ranks: int) -> dict[str, Any]:
    """A row measured in a fresh interpreter: nothing else's memory in its tree."""
    import subprocess

    output = subprocess.run(
        [sys.executable, __file__, str(size_mib), str(batch), str(limit_mib), str(service),
         str(ranks)], capture_output=True, text=True, check=True, timeout=300).stdout
    return dict(json.loads(output.strip().splitlines()[-1]))


def main() -> None:
    if len(sys.argv) > 1:
        size, batch, limit, service, *ranks = sys.argv[1:]
        print(json.dumps(row(int(size), int(batch), int(limit),
                             None if service == "None" else service,
                             int(ranks[0]) if ranks else 1)))
        return
    print("| samples x batch | memory_limit | service | peak shared | peak RssAnon growth "
          "| total | limit + 64 MiB |")
    print("|---|---|---|---|---|---|---|")
    for size, batch, limit, service, ranks in ROWS:
        got = one_row_in_a_process(size, batch, limit, service, ranks)
        ranked = f", {ranks} ranks" if ranks > 1 else ""
        verdict = "within" if got["total_mib"] <= limit + 64 else "over"
        print(f"| {size} MiB x {batch}{ranked} | {limit} MiB | {service} | "
              f"{got['shm_mib']:.0f} MiB | {got['anonymous_mib']:.0f} MiB | "
              f"{got['total_mib']:.0f} MiB | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
