"""One loader process for every rank of a node (`service="node"`) against a loader process per
rank (`service="process"`) and PyTorch's DataLoader per rank, with ranks in lock-step as in DDP.

Set-up: 4 ranks on this machine, started by torchrun (gloo; every step ends with an all_reduce
of a small tensor, so each rank waits for the slowest, as DDP does). 256x256 JPEGs with a
photo-like grain (about 15 KB) from the project's HTTP server at 20 ms per request; decode,
random crop 224 and flip with the per-sample rng (uint8, CHW); batches of 32. The trainer's step
is a 5 ms sleep: the accelerator's time, which leaves the CPU to the loaders.

(a) 4 Loaders, service="process": each rank has its loader process and `num_workers` decode
    processes, concurrency 64 each;
(b) service="node": every rank builds the same Loader; one loader process serves the node, with
    `num_workers` decode processes in all and concurrency 256 (the same budget as (a)'s four);
(c) 4 PyTorch DataLoaders over a map-style Dataset, one blocking `requests` GET per item.

Each configuration runs with a few worker counts; the best by samples/s is compared. Reported:
samples/s over the 4 ranks after the warm-up steps; CPU per sample of every process a run
starts (torchrun, trainers, loader services, decode processes, DataLoader workers; not the HTTP
server), start-up and warm-up included, over all the samples delivered, and the same less a run
without a loader (start-up, the steps' sleep and all_reduce); and the p99 over steps of the
slowest rank's wait for its next batch.

    python benchmarks/node.py [--steps 80] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from benchmarks_common import (
    REAP_SECONDS,
    RemoteImages,
    batch_length,
    become_subreaper,
    reap_strays,
)
from tqdm import tqdm

import aioloader
from aioloader._tools.images import make_images
from aioloader.testing import TestServer

RANKS = 4
IMAGE = 256
CROP = 224
PER_RANK_CONCURRENCY = 64
NAMES = {
    "none": "no loader (start-up, sleep, all_reduce)",
    "a": '(a) 4 Loaders, service="process"',
    "b": '(b) 1 Loader, service="node"',
    "c": "(c) 4 torch DataLoaders, requests",
}


def crop_and_flip(item: tuple[bytes, int], rng: np.random.Generator) -> dict[str, Any]:
    """JPEG decode, random crop 224, random horizontal flip; uint8 CHW."""
    from PIL import Image

    raw, label = item
    image = Image.open(io.BytesIO(raw)).convert("RGB")
    left, top = (int(v) for v in rng.integers(0, IMAGE - CROP + 1, size=2))
    pixels = np.asarray(image.crop((left, top, left + CROP, top + CROP)))
    if rng.random() < 0.5:
        pixels = pixels[:, ::-1]
    return {"image": np.ascontiguousarray(pixels.transpose(2, 0, 1)), "label": label}


# ---- in each rank (started by torchrun) ----


@contextlib.contextmanager
def batches_for(spec: dict[str, Any]) -> Iterator[Iterable[Any]]:
    """This rank's batches for one epoch of the configuration `spec` names."""
    kind, workers, batch = spec["kind"], spec["workers"], spec["batch"]
    if kind == "none":
        yield itertools.repeat(np.zeros(batch, np.uint8))
    elif kind in ("a", "b"):
        node = kind == "b"
        with aioloader.Loader(
            aioloader.Files(spec["urls"], spec["labels"]), decode=crop_and_flip,
            batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
            concurrency=PER_RANK_CONCURRENCY * (RANKS if node else 1),
            service="node" if node else "process",
        ) as loader:
            yield loader
    else:
        import torch.utils.data

        dataset = RemoteImages(spec["urls"], spec["labels"], crop_and_flip)
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, drop_last=True)
        yield torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler,
                                          num_workers=workers, drop_last=True)


def rank_main(spec_file: Path) -> None:
    """Run warm-up and timed steps: wait for the next batch, the trainer's sleep, an all_reduce.
    Writes this rank's waits for the timed steps and their wall time to the spec's folder."""
    import torch
    import torch.distributed as dist

    spec = json.loads(spec_file.read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = spec["warmup"] + spec["steps"]
    token = torch.ones(1)
    waits: list[float] = []
    started = 0.0
    with batches_for(spec) as loader, tqdm(total=total, desc=spec["label"], leave=False,
                                           disable=rank != 0) as progress:
        batches = iter(loader)
        for step in range(total):
            if step == spec["warmup"]:
                started = time.perf_counter()
            asked = time.perf_counter()
            batch = next(batches)
            waits.append(time.perf_counter() - asked)
            if batch_length(batch) != spec["batch"]:
                raise RuntimeError(f"rank {rank}, step {step}: a batch of "
                                   f"{batch_length(batch)} samples, expected {spec['batch']}")
            time.sleep(spec["step_ms"] / 1000)
            dist.all_reduce(token)
            progress.update()
        elapsed = time.perf_counter() - started
        del batches, batch
    (spec_file.parent / f"rank{rank}.json").write_text(
        json.dumps({"waits": waits[spec["warmup"]:], "elapsed": elapsed}))
    dist.destroy_process_group()


# ---- in the driver ----


@dataclasses.dataclass
class Result:
    kind: str
    workers: int
    rate: float = float("nan")
    """Samples/s over all ranks, timed steps."""
    cpu: float = float("nan")
    """CPU seconds of every process of the run per sample delivered (warm-up included)."""
    p99_wait: float = float("nan")
    """Seconds: p99 over timed steps of the slowest rank's wait for its batch."""
    error: str = ""

    @property
    def workers_text(self) -> str:
        if self.kind == "none":
            return "-"
        return f"{self.workers}/node" if self.kind == "b" else f"{self.workers}/rank"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(kind: str, workers: int, args: argparse.Namespace, data: dict[str, Any],
        folder: Path, keep: set[int]) -> Result:
    """One torchrun launch of RANKS ranks over one configuration."""
    result = Result(kind, workers)
    out = Path(tempfile.mkdtemp(prefix=f"run-{kind}-", dir=folder))
    label = f"{NAMES[kind]}, {result.workers_text}"
    spec = {"kind": kind, "workers": workers, "batch": args.batch, "warmup": args.warmup,
            "steps": args.steps, "step_ms": args.step_ms, "label": label, **data}
    (out / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(RANKS), os.path.abspath(__file__),
               "--rank-worker", str(out / "spec.json")]
    before = children_cpu()
    torchrun = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        code = torchrun.wait(args.run_timeout)
    except subprocess.TimeoutExpired:
        torchrun.terminate()  # passed on to the ranks; what lingers is reaped or killed below
        code = None
        result.error = f"timed out after {args.run_timeout:g} s"
    killed = reap_strays(keep)
    cpu = children_cpu() - before
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if not result.error and (code != 0 or len(reports) != RANKS):
        result.error = f"torchrun exited with {code}, {len(reports)} of {RANKS} ranks reported"
    if killed:
        result.error = (result.error + "; " if result.error else "") + (
            f"{killed} processes still ran {REAP_SECONDS:g} s after the run: killed, CPU "
            "incomplete")
    if len(reports) == RANKS:
        slowest = np.max([r["waits"] for r in reports], axis=0)
        result.rate = RANKS * args.batch * args.steps / max(r["elapsed"] for r in reports)
        result.cpu = cpu / (RANKS * args.batch * (args.warmup + args.steps))
        result.p99_wait = float(np.percentile(slowest, 99))
    return result


def jpeg_names(folder: Path, args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """Distinct JPEGs, named over and over: exactly one epoch of warm-up + timed steps on each
    rank. Returns (names, labels)."""
    items = make_images(folder, args.images, dimensions=(IMAGE, IMAGE), noise=9)
    count = RANKS * args.batch * (args.warmup + args.steps)
    chosen = [items[i % len(items)] for i in range(count)]
    return [name for name, _ in chosen], [label for _, label in chosen]


def decode_ceiling(folder: Path, names: list[str]) -> float:
    """Samples/s the machine's cores could decode at most: one process's rate of the same
    decode (measured here, for about 2 s) times the cores."""
    raws = [(folder / name).read_bytes() for name in sorted(set(names))]
    rng = np.random.default_rng(0)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < 2.0:
        crop_and_flip((raws[done % len(raws)], 0), rng)
        done += 1
    return len(os.sched_getaffinity(0)) * done / (time.perf_counter() - started)


def best(results: list[Result], kind: str) -> Result | None:
    ran = [r for r in results if r.kind == kind and not r.error]
    return max(ran, key=lambda r: r.rate) if ran else None


def report(results: list[Result], args: argparse.Namespace, image_bytes: float,
           ceiling: float) -> None:
    cores = len(os.sched_getaffinity(0))
    print(f"\n{RANKS} ranks (torchrun, gloo, all_reduce per step) on {cores} cores; "
          f"{args.images} distinct {IMAGE}x{IMAGE} JPEGs (~{image_bytes / 1024:.0f} KB) over HTTP "
          f"at {args.latency_ms:g} ms; decode + crop {CROP} + flip; batch {args.batch}; "
          f"step = {args.step_ms:g} ms sleep; {args.warmup} warm-up + {args.steps} timed steps; "
          f"concurrency {PER_RANK_CONCURRENCY} per rank, {PER_RANK_CONCURRENCY * RANKS} for "
          "the node")
    print("CPU: every process of the run, start-up and warm-up included, per sample delivered; "
          "'net' less the run without a loader")
    baseline = best(results, "none")
    print(f"{'configuration':<42}{'workers':>9}{'samples/s':>11}{'CPU ms/sample':>15}"
          f"{'net':>7}{'p99 slowest wait ms':>21}")
    for kind in ("a", "b", "c"):
        chosen = best(results, kind)
        for r in (r for r in results if r.kind == kind):
            if r.error:
                print(f"{NAMES[kind]:<42}{r.workers_text:>9}  failed: {r.error}")
                continue
            net = r.cpu - baseline.cpu if baseline else float("nan")
            print(f"{NAMES[kind]:<42}{r.workers_text:>9}{r.rate:>11.0f}{r.cpu * 1e3:>15.2f}"
                  f"{net * 1e3:>7.2f}{r.p99_wait * 1e3:>21.1f}{'  *' if r is chosen else ''}")
    if baseline:
        print(f"no loader: {baseline.cpu * 1e3:.2f} CPU ms per sample (start-up and trainers)")
    print(f"ceiling: {ceiling:.0f} samples/s ({cores} cores x one process's decode rate, with "
          "nothing else running)")
    print("* the best worker count of each configuration, compared below")
    a, b = best(results, "a"), best(results, "b")
    if a and b:
        print(f"(b) / (a) samples/s: {b.rate / a.rate:.2f}x (goal >= 1.2)")
        print(f"(b) / (a) p99 of the slowest rank's wait: {b.p99_wait / a.p99_wait:.2f} "
              "(goal <= 0.5)")
    else:
        print("(b) / (a): not measured (a configuration failed or was not run)")


def numbers(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--images", type=int, default=512, help="distinct JPEGs")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--step-ms", type=float, default=5.0, help="the trainer's sleep")
    parser.add_argument("--workers-a", type=numbers, default=[1, 2], help="per rank")
    parser.add_argument("--workers-b", type=numbers, default=[2, 3, 4], help="the node's")
    parser.add_argument("--workers-c", type=numbers, default=[1, 2], help="per rank")
    parser.add_argument("--configs", default="a,b,c", help="which of a,b,c to run")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument("--rank-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_main(args.rank_worker)
        return
    if args.quick:
        args.steps, args.warmup, args.batch, args.images = 6, 2, 8, 32
        args.workers_a, args.workers_b, args.workers_c = [1], [2], [1]
    become_subreaper()
    plan = [("none", 0)] + [(kind, n) for kind in args.configs.split(",")
                            for n in getattr(args, f"workers_{kind}")]
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        names, labels = jpeg_names(folder / "images", args)
        image_bytes = float(np.mean([(folder / "images" / n).stat().st_size
                                     for n in set(names)]))
        ceiling = decode_ceiling(folder / "images", names)
        results = []
        with TestServer(folder / "images", latency_ms=args.latency_ms) as server:
            data = {"urls": [server.url + n for n in names], "labels": labels}
            for kind, workers in plan:
                result = run(kind, workers, args, data, folder, {server.pid})
                results.append(result)
                print(f"{NAMES[kind]}, {result.workers_text}: "
                      + (f"failed: {result.error}" if result.error else
                         f"{result.rate:.0f} samples/s, {result.cpu * 1e3:.2f} CPU ms/sample, "
                         f"p99 slowest wait {result.p99_wait * 1e3:.1f} ms"), flush=True)
    report(results, args, image_bytes, ceiling)


if __name__ == "__main__":
    main()
