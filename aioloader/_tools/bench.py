"""`aioloader bench`: read a dataset flat out, report samples/s, the stage figures and verdict."""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from .._datasets import Dataset, Parquet, Stream
from .._datasets.sources import for_source
from .._loader import Loader


def dataset_for(urls: list[str]) -> Dataset | Stream:
    """The dataset `datasets.sources.for_source` picks, or Parquet files (brace patterns
    expanded, as for tar shards); @FILE reads the URLs from FILE."""
    if len(urls) == 1 and urls[0].startswith("@"):
        urls = Path(urls[0][1:]).read_text().split()
    if all(url.endswith(".parquet") for url in urls):
        return Parquet(urls)
    return for_source(urls)[0]


def bench(
    urls: list[str],
    epochs: int = 1,
    batch_size: int = 64,
    concurrency: int = 64,
    num_workers: int = 2,
    timeline: Path | None = None,
) -> Loader:
    if timeline is not None:
        _check_can_draw()  # before the run, not after it
    loader = Loader(dataset_for(urls), batch_size=batch_size, concurrency=concurrency,
                    num_workers=num_workers)
    seconds = 0.0
    with loader:
        for epoch in range(epochs):
            started, before = time.perf_counter(), loader.stats.samples
            for _ in tqdm(loader, desc=f"epoch {epoch}", unit="batch", leave=False):
                pass
            took = time.perf_counter() - started
            seconds += took
            rate = (loader.stats.samples - before) / took
            print(f"epoch {epoch}: {rate:.0f} samples/s in {took:.2f} s, start-up included")
    print(loader.stats.report(seconds))  # the same clock: one rate, the epochs' together
    if timeline is not None:
        print(f"timeline: {loader.timeline(timeline)}")
    return loader


def _check_can_draw() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(f"matplotlib is needed to draw the timeline: "
                          f"pip install 'aioloader[plot]' ({e})") from None
