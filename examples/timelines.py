"""Timelines of loading with 0, 1 and 2 decode processes: why prefetching hides loading.

Samples come from the test server with 5 ms latency, decode takes 3 ms of CPU each, a training
step takes 50 ms, batch 16. Each picture is the loader's own `loader.timeline()`: the fetch row,
a row per decode process, the consumer's steps (green) and waits (red). Writes
`examples/figures/timeline-{0,1,2}.png`.

    python examples/timelines.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

import aioloader
from aioloader.testing import TestServer

FIGURES = Path(__file__).parent / "figures"


def busy_decode(raw: bytes) -> int:
    """3 ms of CPU, the way a real decode spends it."""
    until = time.perf_counter() + 0.003
    while time.perf_counter() < until:
        pass
    return len(raw)


def main() -> None:
    FIGURES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for i in range(160):
            Path(folder, f"{i}").write_bytes(np.random.default_rng(i).bytes(2048))
        with TestServer(folder, latency_ms=5) as server:
            urls = [f"{server.url}{i}" for i in range(160)]
            for processes in (0, 1, 2):
                loader = aioloader.Loader(aioloader.Files(urls), decode=busy_decode,
                                          batch_size=16, num_workers=processes, concurrency=32,
                                          prefetch=2)
                with loader:
                    started = time.perf_counter()
                    for _batch in loader:
                        time.sleep(0.05)  # the training step
                    seconds = time.perf_counter() - started
                path = loader.timeline(FIGURES / f"timeline-{processes}.png")
                print(f"{processes} decode processes: {seconds:.2f} s for 10 steps of 50 ms; "
                      f"{loader.stats.verdict()}; {path}")


if __name__ == "__main__":
    main()
