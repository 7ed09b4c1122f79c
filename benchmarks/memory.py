"""Memory: peak resident memory of the main process and its decode processes over 5 epochs
(it should stay flat), and what a Files dataset of 10 million keys costs each decode process.

    python benchmarks/memory.py
"""

from __future__ import annotations

import tempfile
import threading

import numpy as np
import psutil

import aioloader


class InMemory(aioloader.Dataset):
    def __len__(self) -> int:
        return 64 * 200

    async def fetch(self, index: int) -> int:
        return index


def image_sized(index: int) -> np.ndarray:
    return np.full((3, 224, 224), index % 7, np.float32)


def as_array(raw: bytes) -> np.ndarray:
    """A decode that gives the decode processes something to do (without one, nothing is
    sent to them)."""
    return np.frombuffer(raw, np.uint8)


def resident_mb() -> tuple[float, float]:
    """(main process, all decode processes) resident set in MB; shared pages count in each."""
    me = psutil.Process()
    zygotes = [p for p in me.children() if "zygote" in " ".join(p.cmdline())]
    workers = [w for zygote in zygotes for w in zygote.children()]  # forked from it
    return me.memory_info().rss / 1e6, sum(w.memory_info().rss for w in workers) / 1e6


class PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = (0.0, 0.0)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            main, workers = resident_mb()
            self.peak = (max(self.peak[0], main), max(self.peak[1], workers))


def epochs_peaks() -> list[tuple[float, float]]:
    loader = aioloader.Loader(InMemory(), decode=image_sized, batch_size=64, num_workers=2,
                              persistent_workers=True)
    peaks = []
    with loader:
        for _ in range(5):
            sampler = PeakSampler()
            sampler.start()
            for _batch in loader:
                pass
            sampler.stop.set()
            sampler.join()
            peaks.append(sampler.peak)
    return peaks


def worker_mb_with_keys(count: int) -> tuple[float, float]:
    """(main process MB, mean decode process MB) after two batches of Files of `count` keys
    (all naming one small file, so that reading works; the keys are stored all the same)."""
    with tempfile.NamedTemporaryFile(suffix="-sample-000000001.bin") as sample:
        sample.write(b"x" * 100)
        sample.flush()
        files = aioloader.Files(sample.name for _ in range(count))
        loader = aioloader.Loader(files, decode=as_array, batch_size=8, num_workers=2,
                                  shuffle=True)
        with loader:
            iterator = iter(loader)
            next(iterator), next(iterator)
            main, workers = resident_mb()
            del iterator
    return main, workers / 2


def main() -> None:
    peaks = epochs_peaks()
    small = worker_mb_with_keys(100)
    large = worker_mb_with_keys(10_000_000)
    print("\npeak resident MB per epoch, batches of 64x3x224x224 float32 (39 MB), prefetch 4:")
    for epoch, (main_mb, workers_mb) in enumerate(peaks, 1):
        print(f"  epoch {epoch}: main {main_mb:7.0f}   decode processes (2) {workers_mb:7.0f}")
    growth = peaks[-1][0] + peaks[-1][1] - peaks[1][0] - peaks[1][1]
    print(f"  growth from epoch 2 to epoch 5: {growth:+.0f} MB")
    print("Files of 10,000,000 keys (paths of about 40 bytes) vs 100:")
    print(f"  main process:        {small[0]:7.0f} MB -> {large[0]:7.0f} MB")
    print(f"  each decode process: {small[1]:7.0f} MB -> {large[1]:7.0f} MB "
          f"({large[1] - small[1]:+.1f} MB; goal < 50 MB)")


if __name__ == "__main__":
    main()
