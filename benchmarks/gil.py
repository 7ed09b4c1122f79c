"""A training step that holds the GIL: the loader in a thread of the trainer (`service=None`)
against the loader service (`service="process"`), and what the trainer pays per batch.

Set-up: 16 KiB objects from the project's HTTP server at 20 ms per request, a trivial decode,
2 decode processes, concurrency 256, batches of 64. The step runs Python for 20 ms (and 5 ms),
holding the GIL as an eager PyTorch step does while Python dispatches its kernels.

The ideal is min(1 / step, the loader's own rate with an idle consumer while another process
keeps one core busy): the trainer takes a core, so the loader gets what is left either way.

Then the hand-over: the training process's CPU time per batch of 64 x 3x224x224 float32 (the
whole process: in a thread, the event loop's work is there too; with the service, only the
client's), consumer idle.

    python benchmarks/gil.py [--batches 150]
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

import aioloader
from aioloader.testing import TestServer

OBJECT_BYTES = 16 * 1024
BATCH = 64
MODES: list[tuple[str, str | None]] = [("thread (service=None)", None),
                                       ('service="process"', "process")]


def trivial(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, np.uint8)[:16].copy()


def image_sized(raw: bytes) -> np.ndarray:
    return np.full((3, 224, 224), raw[0], np.float32)


def hold_the_gil(seconds: float) -> None:
    """Run Python bytecode for `seconds`: the GIL is this thread's but at switch intervals."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def burn(stop: Any) -> None:
    while not stop.is_set():
        hold_the_gil(0.05)


def steps_per_second(loader: aioloader.Loader, steps: int, step_seconds: float, label: str
                     ) -> float:
    """Steps per second over `steps` batches after a warm-up of 10."""
    with tqdm(total=steps + 10, desc=label, leave=False) as progress:
        batches = iter(loader)
        for _ in range(10):
            next(batches)
            progress.update()
        started = time.perf_counter()
        for _ in range(steps):
            next(batches)
            if step_seconds:
                hold_the_gil(step_seconds)
            progress.update()
        elapsed = time.perf_counter() - started
        del batches
    return steps / elapsed


def remote(args: argparse.Namespace, folder: Path) -> None:
    count = BATCH * (args.batches + 12)
    rng = np.random.default_rng(0)
    for i in range(count):
        (folder / f"{i:05d}.bin").write_bytes(rng.bytes(OBJECT_BYTES))
    rows = []
    with TestServer(folder, latency_ms=20) as server:
        urls = [f"{server.url}{i:05d}.bin" for i in range(count)]
        for name, service in MODES:
            with aioloader.Loader(aioloader.Files(urls), decode=trivial, batch_size=BATCH,
                                  num_workers=2, concurrency=256, service=service,
                                  persistent_workers=True) as loader:
                stop = multiprocessing.Event()
                hog = multiprocessing.Process(target=burn, args=(stop,))
                hog.start()
                try:
                    idle = steps_per_second(loader, args.batches, 0, f"{name}, idle + hog")
                finally:
                    stop.set()
                    hog.join()
                rates = {ms: steps_per_second(loader, args.batches, ms / 1000,
                                              f"{name}, {ms} ms step") for ms in (20, 5)}
            rows.append((name, idle, rates))
    print(f"\nGIL-holding step: 16 KiB objects over HTTP at 20 ms, trivial decode, 2 decode "
          f"processes, concurrency 256, batches of {BATCH}, {args.batches} steps each")
    print(f"{'loader':<24}{'idle+hog b/s':>14}{'step':>7}{'steps/s':>10}{'ideal':>8}"
          f"{'ratio':>8}")
    for name, idle, rates in rows:
        for ms, rate in rates.items():
            ideal = min(1000 / ms, idle)
            print(f"{name:<24}{idle:>14.1f}{ms:>5} ms{rate:>10.1f}{ideal:>8.1f}"
                  f"{rate / ideal:>8.2f}")


def handover(args: argparse.Namespace, folder: Path) -> None:
    count = BATCH * args.handover_batches
    for i in range(count):
        (folder / f"h{i:05d}.bin").write_bytes(bytes([i % 251]) * 16)
    paths = [str(folder / f"h{i:05d}.bin") for i in range(count)]
    print(f"\nHand-over: training process CPU per batch of {BATCH} x 3x224x224 float32 "
          f"({BATCH * 3 * 224 * 224 * 4 / 2**20:.0f} MiB), {args.handover_batches} batches, "
          "local files, 2 decode processes")
    for name, service in MODES:
        with aioloader.Loader(aioloader.Files(paths), decode=image_sized, batch_size=BATCH,
                              num_workers=2, service=service, persistent_workers=True,
                              memory_limit=2 << 30) as loader:
            for _ in loader:  # warm up: processes, blocks
                pass
            cpu, wall = time.process_time(), time.perf_counter()
            seen = sum(1 for _ in loader)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(f"{name:<24}{cpu / seen * 1e3:>8.2f} ms CPU per batch "
              f"({seen / wall:.1f} batches/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--handover-batches", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        remote(args, Path(folder))
        handover(args, Path(folder))


if __name__ == "__main__":
    main()
