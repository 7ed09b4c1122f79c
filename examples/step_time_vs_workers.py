"""Step time against the number of workers, the classic data-loading experiment.

Each item takes 0.5 ms to load; a training step takes 0.1 s; batch 64. PyTorch's DataLoader with
0..8 workers against aioloader with 0..2 decode processes (64 reads in flight). Then the same
with every item behind 20 ms of latency (the project's test server on 127.0.0.1), where a loader
with one read in flight per worker needs dozens of processes. Writes
`examples/figures/step_time_vs_workers.png` and prints the table.

    python examples/step_time_vs_workers.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

import aioloader
from aioloader.testing import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from benchmarks_common import RequestsDataset

STEP_SECONDS = 0.1
LOAD_SECONDS = 0.0005
BATCH = 64
FIGURES = Path(__file__).parent / "figures"


def load_item(raw: Any) -> int:
    """0.5 ms of loading work for one item (in a worker or decode process)."""
    time.sleep(LOAD_SECONDS)
    return len(raw) if isinstance(raw, bytes) else int(raw)


class LocalItems(aioloader.Dataset):
    """Map-style for both loaders: PyTorch calls __getitem__, aioloader fetch + decode."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> int:
        return load_item(index)

    async def fetch(self, index: int) -> int:
        return index


class RemoteItems(RequestsDataset):
    """One blocking GET per item, then the 0.5 ms of loading."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(urls, load_item)


def mean_step_seconds(batches: Iterable[Any], steps: int, buffered: int) -> float:
    """The mean wall time of `steps` training steps of 0.1 s, once the `buffered` batches a
    loader prefetched at its start are used up (they would flatter the first steps)."""
    iterator = iter(batches)
    for _ in range(buffered + 1):
        next(iterator)
        time.sleep(STEP_SECONDS)
    started = time.perf_counter()
    for _ in range(steps):
        next(iterator)
        time.sleep(STEP_SECONDS)
    return (time.perf_counter() - started) / steps


def torch_step(dataset: Any, workers: int, steps: int) -> float:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True,
                                         num_workers=workers)
    return mean_step_seconds(loader, steps, buffered=2 * workers)  # prefetch_factor 2


def aioloader_step(dataset: aioloader.Dataset, processes: int, steps: int) -> float:
    loader = aioloader.Loader(dataset, decode=load_item, batch_size=BATCH, shuffle=True,
                              num_workers=processes, concurrency=64)
    with loader:
        return mean_step_seconds(loader, steps, buffered=loader.prefetch)


def draw(rows: dict[str, dict[str, dict[int, float]]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for panel, (title, lines) in zip(panels, rows.items(), strict=True):
        for name, points in lines.items():
            panel.plot(list(points), list(points.values()), marker="o", label=name)
        panel.axhline(STEP_SECONDS, color="grey", linestyle=":", label="training step alone")
        panel.set_title(title, fontsize=10)
        panel.set_xlabel("worker / decode processes")
        panel.set_ylabel("seconds per step")
        panel.set_yscale("log")
        panel.legend(fontsize=8)
    figure.tight_layout()
    FIGURES.mkdir(exist_ok=True)
    out = FIGURES / "step_time_vs_workers.png"
    figure.savefig(out, dpi=110)
    return out


def main() -> None:
    local = LocalItems()
    rows: dict[str, dict[str, dict[int, float]]] = {
        "items load in 0.5 ms": {
            "PyTorch DataLoader": {w: torch_step(local, w, 10) for w in range(9)},
            "aioloader": {p: aioloader_step(local, p, 10) for p in range(3)},
        }
    }
    with tempfile.TemporaryDirectory() as folder:
        for i in range(5000):
            Path(folder, f"{i}").write_bytes(np.random.default_rng(i).bytes(1024))
        with TestServer(folder, latency_ms=20) as server:
            urls = [f"{server.url}{i}" for i in range(5000)]
            remote = RemoteItems(urls)
            rows["items 20 ms away (HTTP), + 0.5 ms to load"] = {
                "PyTorch DataLoader": {w: torch_step(remote, w, 8) for w in range(9)},
                "aioloader": {p: aioloader_step(aioloader.Files(urls), p, 10) for p in range(3)},
            }
    for title, lines in rows.items():
        print(f"{title} (seconds per 0.1 s training step, batch {BATCH}):")
        for name, points in lines.items():
            print(f"  {name:<20}" + "".join(f"  {w}: {s:.3f}" for w, s in points.items()))
    print(f"figure: {draw(rows)}")


if __name__ == "__main__":
    main()
