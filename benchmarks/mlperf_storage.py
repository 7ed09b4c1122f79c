"""MLPerf Storage's workloads as DLIO defines them, scaled to this machine: the accelerator
utilisation (AU) of ranks that sleep a fixed compute time per batch, fed by aioloader or by a
PyTorch DataLoader that reads as DLIO's PyTorch loader does.

AU, DLIO's definition: the share of a rank's run spent computing, the batches' compute time over
the wall time from its first timed request for a batch to the end of its last step; the mean
over ranks is reported (and the lowest). A run is valid at AU >= 0.90, and the figure of merit
is the most ranks one host keeps at or above it.

Workloads, from DLIO's `unet3d_h100` and `resnet50_h100` configurations, scaled:
- unet3d: one `.npz` sample per file, 20 to 40 MB (DLIO: 146 MB, standard deviation 68 MB;
  fewer megabytes for this machine's 24 GiB), batch 7, 0.323 s of compute per batch, each
  sample resized to 2 MiB once read (DLIO's `record_length_resize`);
- resnet50: one `.npz` sample of 115 KB per file (DLIO: 1251 records of 114,660 B per TFRecord
  file), batch 400, 0.224 s of compute per batch, resized to 150 KB (224 x 224 x 3).

Each is read from local disk (page cache warm: the dataset fits in memory here) and from the
project's HTTP server with 20 ms per request, at 1, 2, 4 and 8 ranks (torchrun, gloo, a barrier
before the first step). aioloader: `Files` of the paths or URLs, `np.load` in decode, one
`service="node"` for the node's ranks with 2 decode processes in all; DataLoader: DLIO's reader
(`np.load(path)["x"]`, or one `requests` GET per item), 2 workers per rank, a
`DistributedSampler`. The 2 cores of this machine are what every rank's loader shares.

    python benchmarks/mlperf_storage.py [--ranks 1,2,4,8] [--workloads unet3d,resnet50]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from benchmarks_common import RequestsDataset, become_subreaper, reap_strays
from tqdm import tqdm

import aioloader
from aioloader.testing import TestServer


@dataclasses.dataclass(frozen=True)
class Workload:
    sizes: tuple[int, int]
    """Bytes of a sample's array, lowest and highest (uniform between)."""
    files: int
    batch: int
    compute: float
    """Seconds per batch: the accelerator's time."""
    resized: int
    """Bytes a sample is cut to once read: what goes on to the training loop."""
    steps: int
    warmup: int


WORKLOADS = {
    "unet3d": Workload((20 << 20, 40 << 20), files=64, batch=7, compute=0.323,
                       resized=2 << 20, steps=12, warmup=2),
    "resnet50": Workload((115_000, 115_000), files=8000, batch=400, compute=0.224,
                         resized=150_528, steps=8, warmup=1),
}
THRESHOLD = 0.90
WORKERS = 2


def resized(array: np.ndarray[Any, Any], size: int) -> np.ndarray[Any, Any]:
    """The first `size` bytes of a sample read whole, as DLIO keeps a resized copy."""
    return np.frombuffer(array.data, np.uint8, count=min(size, array.nbytes)).copy()


class DecodeNpz:
    """What a sample becomes in decode: its `.npz` read, its `x` resized."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, raw: bytes) -> np.ndarray[Any, Any]:
        return resized(np.load(io.BytesIO(raw))["x"], self.size)


class NpzFiles:
    """DLIO's PyTorch reader of `.npz` files: each worker loads its sample's file."""

    def __init__(self, paths: list[str], size: int) -> None:
        self.paths, self.size = paths, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        return resized(np.load(self.paths[index])["x"], self.size)


# ---- in each rank (started by torchrun) ----


@contextmanager
def batches_for(spec: dict[str, Any]) -> Iterator[Any]:
    """This rank's loader: aioloader with one service for the node, or a DataLoader."""
    decode = DecodeNpz(spec["resized"])
    if spec["loader"] == "aioloader":
        with aioloader.Loader(aioloader.Files(spec["urls"]), decode=decode,
                              batch_size=spec["batch"], shuffle=True, drop_last=True,
                              num_workers=WORKERS, service="node") as loader:
            yield loader
        return
    import torch.utils.data

    remote = spec["urls"][0].startswith("http")
    dataset: Any = (RequestsDataset(spec["urls"], decode) if remote
                    else NpzFiles(spec["urls"], spec["resized"]))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, drop_last=True)
    yield torch.utils.data.DataLoader(dataset, batch_size=spec["batch"], sampler=sampler,
                                      num_workers=WORKERS, drop_last=True,
                                      persistent_workers=True)


def epochs_of(loader: Any) -> Iterator[Any]:
    """Batches of epoch after epoch (the dataset is smaller than a run reads)."""
    for epoch in itertools.count():
        setter = getattr(loader, "set_epoch", None) or loader.sampler.set_epoch
        setter(epoch)
        yield from loader


def rank_main(spec_file: Path) -> None:
    """Warm-up steps, then timed ones: wait for a batch, sleep the compute time. Writes this
    rank's AU over the timed steps."""
    import torch.distributed as dist

    spec = json.loads(spec_file.read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = spec["warmup"] + spec["steps"]
    with batches_for(spec) as loader:
        batches = epochs_of(loader)
        dist.barrier()
        started = 0.0
        for step in tqdm(range(total), desc=spec["label"], leave=False, disable=rank != 0):
            if step == spec["warmup"]:
                started = time.perf_counter()
            batch = next(batches)
            if len(batch) != spec["batch"]:
                raise RuntimeError(f"rank {rank}: a batch of {len(batch)}")
            time.sleep(spec["compute"])
        elapsed = time.perf_counter() - started
        batches.close()
    au = spec["steps"] * spec["compute"] / elapsed
    (spec_file.parent / f"rank{rank}.json").write_text(json.dumps({"au": au}))
    dist.destroy_process_group()


# ---- in the driver ----


def run(loader: str, ranks: int, workload: Workload, label: str, urls: list[str],
        folder: Path, keep: set[int], timeout: float) -> list[float] | str:
    """One torchrun launch: each rank's AU, or what went wrong."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=folder))
    spec = {"loader": loader, "urls": urls, "label": label,
            **dataclasses.asdict(workload)}
    (out / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(ranks), os.path.abspath(__file__),
               "--rank-worker", str(out / "spec.json")]
    torchrun = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, errors = torchrun.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        torchrun.terminate()
        torchrun.communicate()
        reap_strays(keep)
        return f"timed out after {timeout:g} s"
    reap_strays(keep)
    reports = [json.loads(p.read_text())["au"] for p in sorted(out.glob("rank*.json"))]
    if torchrun.returncode != 0 or len(reports) != ranks:
        return f"torchrun exited with {torchrun.returncode}: {errors.decode()[-800:]}"
    return list(reports)


def write_dataset(folder: Path, workload: Workload, seed: int = 0) -> list[str]:
    """The workload's `.npz` files (uncompressed, as DLIO generates them)."""
    folder.mkdir()
    rng = np.random.default_rng(seed)
    low, high = workload.sizes
    paths = []
    for n in tqdm(range(workload.files), desc=f"writing {folder.name}", leave=False):
        size = int(rng.integers(low, high + 1))
        path = folder / f"sample-{n:05d}.npz"
        np.savez(path, x=np.full(size, n % 251, np.uint8))
        paths.append(str(path))
    for path in paths:  # into the page cache
        Path(path).read_bytes()
    return paths


def numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=numbers, default=[1, 2, 4, 8])
    parser.add_argument("--workloads", default="unet3d,resnet50")
    parser.add_argument("--stores", default="local,http")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--rank-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_main(args.rank_worker)
        return
    become_subreaper()
    table: list[str] = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        for name in args.workloads.split(","):
            workload = WORKLOADS[name]
            paths = write_dataset(folder / name, workload)
            with TestServer(folder / name, latency_ms=args.latency_ms) as server:
                for store in args.stores.split(","):
                    urls = paths if store == "local" else [
                        server.url + Path(p).name for p in paths]
                    best: dict[str, int] = {}
                    for loader, ranks in itertools.product(("DataLoader", "aioloader"),
                                                           args.ranks):
                        label = f"{name}, {store}, {loader}, {ranks} rank(s)"
                        outcome = run(loader, ranks, workload, label, urls, folder,
                                      {server.pid}, args.run_timeout)
                        if isinstance(outcome, str):
                            print(f"{label}: failed: {outcome}", flush=True)
                            continue
                        mean = float(np.mean(outcome))
                        print(f"{label}: AU {mean:.2f} (lowest {min(outcome):.2f})",
                              flush=True)
                        table.append(f"| {name} | {store} | {loader} | {ranks} | {mean:.2f} | "
                                     f"{min(outcome):.2f} |")
                        if mean >= THRESHOLD:
                            best[loader] = max(best.get(loader, 0), ranks)
                    for loader in ("DataLoader", "aioloader"):
                        table.append(f"| {name} | {store} | {loader} | most ranks at AU >= "
                                     f"{THRESHOLD:.2f}: {best.get(loader, 0)} | | |")
    print("\n| workload | store | loader | ranks | AU (mean) | AU (lowest rank) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
