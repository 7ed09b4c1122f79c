"""CPU per large sample (22 MB, as MLPerf Storage's unet3d reads them): what the loader's
processes spend to read a local file (or, with --http, an object from a server on this
machine) and hand it to decode, against PyTorch's DataLoader whose workers read their own
files (or GET their own objects). Both decode alike (`np.load`) and give back only the array's
length, so the batch's way back costs next to nothing. CPU is counted in every process of the
job (this one and its descendants: DataLoader's workers, aioloader's zygote and decode
processes; not the server's), from before the first batch to after the last, in the same run.

    python benchmarks/large_samples.py [--samples 40] [--megabytes 22] [--http]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import tempfile
from typing import Any

import numpy as np
from benchmarks_common import RequestsDataset, samples_per_second

import aioloader
from aioloader.testing import TestServer

TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def job_cpu() -> dict[int, float]:
    """CPU seconds of this process and of each live descendant, by pid."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    seconds = {os.getpid(): usage.ru_utime + usage.ru_stime}
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[pid] = (int(fields[11]) + int(fields[12])) / TICKS
    return seconds


def spent(before: dict[int, float], after: dict[int, float], server: int | None) -> float:
    """CPU spent between two readings, in processes alive at the second, but the server."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items() if pid != server)


def length_of(raw: bytes) -> int:
    return len(np.load(io.BytesIO(raw)))


class NpyFiles:
    """What a DataLoader user writes: each worker opens its own file."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> int:
        return len(np.load(self.paths[index]))


def measure(batches: Any, samples: int, description: str, server: int | None
            ) -> tuple[float, float]:
    """(CPU ms per sample, samples/s) of a second epoch: the processes are started."""
    before = job_cpu()
    rate = samples_per_second(batches, samples, description)
    return spent(before, job_cpu(), server) / samples * 1000, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--megabytes", type=int, default=22)
    parser.add_argument("--http", action="store_true",
                        help="read over HTTP from a server on this machine, no latency added")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        paths = []
        for n in range(args.samples):
            path = os.path.join(folder, f"sample-{n:04d}.npy")
            np.save(path, np.full(args.megabytes * 2**20 // 4, n, np.float32))
            paths.append(path)
        for path in paths:  # in the page cache for both
            with open(path, "rb") as file:
                while file.read(2**24):
                    pass

        server = None
        theirs_data: Any = NpyFiles(paths)
        if args.http:
            served = stack.enter_context(TestServer(folder))
            server = served.pid
            paths = [served.url + os.path.basename(path) for path in paths]
            theirs_data = RequestsDataset(paths, length_of)

        import torch.utils.data

        torch_loader = torch.utils.data.DataLoader(
            theirs_data, batch_size=1, num_workers=2, persistent_workers=True)
        list(torch_loader)  # workers started
        theirs = measure(torch_loader, args.samples, "DataLoader", server)
        del torch_loader

        loader = aioloader.Loader(aioloader.Files(paths), decode=length_of, batch_size=1,
                                  num_workers=2, persistent_workers=True, service=None)
        with loader:
            list(loader)  # decode processes started, objects' sizes learnt
            ours = measure(loader, args.samples, "aioloader", server)
            how = ("into shared memory" if loader.stats.shared_bytes else
                   "read in decode" if loader.stats.read_in_decode else "sent to decode")

    where = "HTTP objects (a server on this machine, its CPU not counted)" if args.http else \
        "local samples"
    print(f"{args.samples} {where} of {args.megabytes} MiB, batch 1, 2 workers, "
          "page cache warm; CPU of every process of the job")
    print("| loader | CPU per sample | samples/s |\n|---|---|---|")
    print(f"| DataLoader (workers read their own) | {theirs[0]:.1f} ms | {theirs[1]:.1f} |")
    print(f"| aioloader (Files, {how}) | {ours[0]:.1f} ms | {ours[1]:.1f} |")
    print(f"CPU per sample, aioloader / DataLoader: {ours[0] / theirs[0]:.2f}x")


if __name__ == "__main__":
    main()
