"""Decoding on a cluster against the built-in pool: JPEGs read from the test server at 20 ms
latency, decoded (decode, random resized crop 224, flip, float32 normalise) on each backend
with 2 processes: the pool, a Dask LocalCluster (2 worker processes), Ray on this machine
(2 actors). Reported per backend: images/s (epoch 2, epoch 1 in brackets), CPU per image (the
trainer's own process, and everything else the run started), and the bytes each image ships
to a worker and back. Then a paper estimate of remote decoding for a trainer host with N cores
and a CPU cluster with M, from those per-image costs.

    python benchmarks/cluster.py [--images 1024] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from benchmarks_common import LocalImages, samples_per_second

import aioloader
from aioloader._tools.images import decode_and_augment, make_images
from aioloader.testing import TestServer

BATCH = 64
WORKERS = 2
LINK_GBIT = 10.0
"""The network link of the paper estimate, per trainer host."""


def cpu_seconds(skip: set[int]) -> tuple[float, float]:
    """(this process's CPU seconds, its descendants' but those in `skip` and theirs)."""
    me = psutil.Process()
    others = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.pid in skip or any(p.pid in skip for p in child.parents()):
                continue
            times = child.cpu_times()
            others += times.user + times.system
    own = me.cpu_times()
    return own.user + own.system, others


def measure(name: str, executor: Any, urls: list[str], labels: list[int], server: int
            ) -> dict[str, float]:
    """Two epochs; images/s of each, CPU ms per image in epoch 2 (trainer, the rest)."""
    options: dict[str, Any] = {"executor": executor} if executor is not None else {
        "persistent_workers": True}
    loader = aioloader.Loader(aioloader.Files(urls, labels), decode=decode_and_augment,
                              batch_size=BATCH, shuffle=True, num_workers=WORKERS,
                              concurrency=128, **options)
    with loader:
        first = samples_per_second(loader, len(urls), f"{name} epoch 1")
        own, others = cpu_seconds({server})
        second = samples_per_second(loader, len(urls), f"{name} epoch 2")
        own_after, others_after = cpu_seconds({server})
    return {"first": first, "second": second,
            "trainer_ms": 1000 * (own_after - own) / len(urls),
            "rest_ms": 1000 * (others_after - others) / len(urls)}


@contextlib.contextmanager
def dask_client() -> Iterator[Any]:
    import distributed

    with distributed.LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True,
                                  dashboard_address=None, host="127.0.0.1") as cluster, \
            distributed.Client(cluster) as client:
        yield client


@contextlib.contextmanager
def ray_local() -> Iterator[str]:
    """Ray on this machine, on loopback; `executor="ray"` finds it running."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(address="local", num_cpus=WORKERS, include_dashboard=False,
             configure_logging=False, object_store_memory=500_000_000)
    try:
        yield "ray"
    finally:
        ray.shutdown()


def shipped_bytes(paths: list[str], labels: list[int]) -> tuple[float, float]:
    """Bytes per image a chunk carries to a worker, and its batch back, pickled."""
    raws = [(Path(p).read_bytes(), label)
            for p, label in zip(paths[:BATCH], labels[:BATCH], strict=True)]
    rng = np.random.default_rng(0)
    batch = aioloader.default_collate([decode_and_augment(raw, rng) for raw in raws])
    return (len(pickle.dumps(raws, protocol=5)) / BATCH,
            len(pickle.dumps(batch, protocol=5)) / BATCH)


def one_process_ms(paths: list[str], labels: list[int], count: int = 200) -> float:
    dataset = LocalImages(paths[:count], labels[:count], decode_and_augment)
    started = time.process_time()
    for i in range(len(dataset)):
        dataset[i]
    return 1000 * (time.process_time() - started) / count


def estimate(decode_ms: float, trainer_ms: float, shipped: float, cores: int, cluster: int
             ) -> tuple[float, str]:
    """The remote-decode speed-up for a trainer host of `cores` and a cluster of `cluster`
    cores, over decoding on the trainer host, and what bounds it."""
    local = cores * 1000 / decode_ms
    bounds = {"the cluster's cores": cluster * 1000 / decode_ms,
              "the trainer's CPU": cores * 1000 / trainer_ms,
              "the link": LINK_GBIT * 1e9 / 8 / shipped}
    bound = min(bounds, key=bounds.__getitem__)
    return bounds[bound] / local, bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()

    backends: list[tuple[str, Callable[[], Any]]] = [
        ("built-in pool", contextlib.nullcontext),
        ("Dask LocalCluster", dask_client),
        ("Ray, this machine", ray_local),
    ]
    with tempfile.TemporaryDirectory() as folder:
        items = make_images(Path(folder), args.images, dimensions=(500, 375))
        paths = [str(Path(folder) / name) for name, _ in items]
        labels = [label for _, label in items]
        decode_ms = one_process_ms(paths, labels)
        to_worker, from_worker = shipped_bytes(paths, labels)
        results = {}
        with TestServer(folder, latency_ms=args.latency_ms) as server:
            urls = [server.url + name for name, _ in items]
            for name, start in backends:
                with start() as executor:
                    results[name] = measure(name, executor, urls, labels, server.pid)

    pool = results["built-in pool"]
    print(f"\n{args.images} JPEGs 500x375 over HTTP at {args.latency_ms:g} ms; decode + random "
          f"resized crop 224 + flip + float32 normalise, batch {BATCH}, {WORKERS} processes; "
          "2 cores")
    print(f"one process decodes an image in {decode_ms:.2f} ms of CPU; a chunk ships "
          f"{to_worker / 1e3:.0f} KB per image to a worker and {from_worker / 1e3:.0f} KB back "
          "(the pool returns it through shared memory)")
    print(f"{'backend':<20} {'images/s epoch 2 [1]':>22} {'of pool':>8} "
          f"{'CPU ms/image: trainer':>22} {'rest':>6}")
    for name, figures in results.items():
        print(f"{name:<20} {figures['second']:>14.0f} [{figures['first']:5.0f}] "
              f"{figures['second'] / pool['second']:>7.2f}x {figures['trainer_ms']:>22.2f} "
              f"{figures['rest_ms']:>6.2f}")
    for name in ("Dask LocalCluster", "Ray, this machine"):
        print(f"{name}: {results[name]['second'] / pool['second']:.2f} of the pool "
              "(goal >= 0.8)")
    print(f"\nPaper estimate of remote decoding over decoding on the trainer host (decode "
          f"{decode_ms:.2f} ms/image; the trainer's CPU per image as measured for each backend; "
          f"a {LINK_GBIT:g} Gbit/s link; the batch shipped back as float32, as here, or as "
          "uint8, normalised on the trainer):")
    outputs = {"float32": to_worker + from_worker, "uint8": to_worker + from_worker / 4}
    for name in ("Dask LocalCluster", "Ray, this machine"):
        trainer_ms = results[name]["trainer_ms"]
        for cores, cluster in ((8, 64), (8, 256), (32, 256)):
            line = []
            for output, shipped in outputs.items():
                speedup, bound = estimate(decode_ms, trainer_ms, shipped, cores, cluster)
                line.append(f"{output} {speedup:.1f}x ({bound})")
            print(f"  {name}, trainer {cores} cores, cluster {cluster}: " + "; ".join(line))


if __name__ == "__main__":
    main()
