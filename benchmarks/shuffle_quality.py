"""Shuffle quality of streamed epochs: how close is the order a training loop sees to a uniform
permutation, for a given shuffle buffer or window, and what memory buys it.

A streamed format (tar shards, Parquet) cannot be read in a uniformly random order without one
request per sample; it shuffles the shard or row-group order and then mixes samples in a
buffer or window held in memory. This benchmark writes N samples in order (each sample's content
is its original position), reads epochs through each loader for real (aioloader's Loader with
num_workers=0 and batch_size=None; WebDataset's pipeline as its documentation sets it up), and
compares the order it gets with a uniform permutation and with no shuffle at all:

- displacement: mean |epoch position - original position|, over a uniform permutation's
  ((N^2 - 1) / 3N, about N/3): 1.0 is as far as uniform moves samples. It mostly measures the
  shard or row-group order, which every setting shuffles.
- Spearman rho between original and epoch position: 0 none left, 1 not shuffled at all.
- batch spread: the spread (standard deviation) of original positions within a batch of 64,
  over a uniform permutation's: 1.0 is uniform, near 0 is a batch of neighbours.
- same-source pairs: how often two samples of a batch of 64 come from the same shard (tar) or
  row group (Parquet), over how often they would in a uniform permutation: 1.0 is uniform,
  16 means "16 times more often", the most a 16-shard layout allows.
- memory: samples held for shuffling (buffer samples, or window rows), and their size at a
  nominal sample size (--sample-kib); read-ahead comes on top, listed under the table.

Each measure is the mean over --epochs epochs (default 3; 1 with --small), seed 0: with few
shards, one epoch's shard order alone moves displacement and Spearman rho a lot.

Set-up, in a virtual environment of its own (webdataset pulls in torch: install the CPU build
2.13.0 first, then pin it, or pip fetches gigabytes):

    python3 -m venv benchvenv
    benchvenv/bin/pip install torch==2.13.0
    echo torch==2.13.0 > constraints.txt
    benchvenv/bin/pip install -c constraints.txt webdataset pyarrow numpy tqdm matplotlib
    benchvenv/bin/pip install -c constraints.txt -e '.[parquet]'

Run from the repository root (--small: 10,000 samples, one epoch, under a minute in all; the
default size reads about 40 epochs of 100,000 samples, roughly ten minutes on 2 cores):

    benchvenv/bin/python benchmarks/shuffle_quality.py [--small] [--samples 100000]

Prints a table and saves benchmarks/figures/shuffle_quality.png.
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

import aioloader

BATCH = 64
TAR_SHARD_COUNTS = (16, 128)
TAR_BUFFERS = (0, 100, 1000, 10_000)
PARQUET_WINDOWS = (1, 2, 4, 16)
PARQUET_FILES = 10
ROW_GROUPS = 100
"""Row groups in all: rows per group = N / 100 (1000 for the default N)."""
WEBDATASET_SHARD_SHUFFLE, WEBDATASET_BUFFER = 100, 1000
"""WebDataset's documented set-up: shardshuffle=100 (what True means) and .shuffle(1000)."""
SEED = 0
FIGURE = Path(__file__).parent / "figures" / "shuffle_quality.png"

Order = npt.NDArray[np.int64]
"""order[k] = original position of the k-th sample of the epoch."""


@dataclass(frozen=True)
class Layout:
    """How the N samples lie in files: `source[i]` is the shard or row group of sample i."""

    name: str
    urls: list[str]
    source: npt.NDArray[np.int64]


@dataclass(frozen=True)
class Result:
    loader: str
    layout: str
    setting: str
    held: int
    """Samples held for shuffling; -1 for the uniform reference (needs random access)."""
    displacement: float
    spearman: float
    spread: float
    same_source: float


# --- data -----------------------------------------------------------------------------------


def write_tar_shards(folder: Path, samples: int, shards: int) -> Layout:
    """WebDataset shards: sample i is `{i:07d}.idx` holding str(i), shards cut in order."""
    folder.mkdir(parents=True)
    urls, source = [], np.empty(samples, dtype=np.int64)
    for shard, positions in enumerate(np.array_split(np.arange(samples), shards)):
        path = folder / f"shard-{shard:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in positions.tolist():
                data = str(i).encode()
                member = tarfile.TarInfo(f"{i:07d}.idx")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        source[positions] = shard
        urls.append(str(path))
    return Layout(f"{shards} shards", urls, source)


def write_parquet(folder: Path, samples: int) -> Layout:
    """Files of row groups holding one int64 column `position`, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    group_rows = max(samples // ROW_GROUPS, 1)
    urls, sources = [], []
    for number, positions in enumerate(np.array_split(np.arange(samples), PARQUET_FILES)):
        path = folder / f"part-{number:03d}.parquet"
        pq.write_table(pa.table({"position": positions}), path, row_group_size=group_rows)
        urls.append(str(path))
        first_group = sources[-1][-1] + 1 if sources else 0
        sources.append(first_group + np.arange(len(positions), dtype=np.int64) // group_rows)
    return Layout(f"row groups of {group_rows}", urls, np.concatenate(sources))


# --- epochs through each loader ---------------------------------------------------------------


def drain(items: Iterable[dict[str, Any]], key: str, samples: int, what: str) -> Order:
    """Original positions in the order the loader hands the items over."""
    order = [int(item[key]) for item in tqdm(items, total=samples, desc=what, leave=False)]
    if sorted(order) != list(range(samples)):
        raise RuntimeError(f"{what}: the epoch is not a permutation of the {samples} samples")
    return np.array(order, dtype=np.int64)


def aioloader_orders(dataset: aioloader.Stream, key: str, samples: int, shuffle: bool,
                     epochs: int, what: str) -> list[Order]:
    """Epochs 0, 1, ... as training sees them: samples one by one, in the loader's order (a
    pass that runs to the end moves the loader to the next epoch)."""
    loader = aioloader.Loader(dataset, decode=None, batch_size=None, num_workers=0,
                              shuffle=shuffle, seed=SEED)
    with loader:
        return [drain(loader, key, samples, f"{what}, epoch {e}") for e in range(epochs)]


def webdataset_orders(layout: Layout, samples: int, epochs: int) -> list[Order]:
    """WebDataset as its documentation recommends, read from local files in this process.

    With a fixed seed its shuffles repeat the same order every pass, so each epoch gets a
    pipeline seeded SEED + epoch (what its detshuffle does); with no seed it draws one."""
    import webdataset

    orders = []
    for epoch in range(epochs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dataset = webdataset.WebDataset(
                layout.urls, shardshuffle=WEBDATASET_SHARD_SHUFFLE, seed=SEED + epoch
            ).shuffle(WEBDATASET_BUFFER, seed=SEED + epoch)
            what = f"WebDataset, {layout.name}, epoch {epoch}"
            orders.append(drain(dataset, "idx", samples, what))
    return orders


# --- measures -------------------------------------------------------------------------------


def displacement(order: Order) -> float:
    """Mean |epoch position - original position| over a uniform permutation's expectation."""
    n = len(order)
    moved = np.abs(order - np.arange(n)).mean()
    return float(moved / ((n * n - 1) / (3 * n)))


def spearman(order: Order) -> float:
    """Rank correlation of original and epoch positions (both are already ranks)."""
    n = len(order)
    squared = np.square((order - np.arange(n)).astype(np.float64)).sum()
    return float(1 - 6 * squared / (n * (n * n - 1)))


def batches(values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The epoch cut into full batches of BATCH (a last, partial batch is left out)."""
    full = len(values) // BATCH * BATCH
    return values[:full].reshape(-1, BATCH)


def batch_spread(order: Order) -> float:
    """Root-mean-square of each batch's standard deviation of original positions, over a
    uniform permutation's (a batch drawn without replacement: variance N(N+1)/12)."""
    n = len(order)
    variance = batches(order).astype(np.float64).var(axis=1, ddof=1).mean()
    return float(np.sqrt(variance / (n * (n + 1) / 12)))


def same_source_pairs(order: Order, source: npt.NDArray[np.int64]) -> float:
    """How often two samples of one batch share a shard or row group, over how often they
    would in a uniform permutation."""
    n = len(order)
    sizes = np.bincount(source).astype(np.float64)
    uniform = float((sizes * (sizes - 1)).sum() / (n * (n - 1)))
    rows = batches(source[order])
    counts = np.zeros((len(rows), len(sizes)))
    np.add.at(counts, (np.repeat(np.arange(len(rows)), BATCH), rows.ravel()), 1)
    observed = float((counts * (counts - 1)).sum(axis=1).mean() / (BATCH * (BATCH - 1)))
    return observed / uniform


def measure(orders: list[Order], layout: Layout, loader: str, setting: str,
            held: int) -> Result:
    """Each measure averaged over the epochs."""

    def mean(values: Iterable[float]) -> float:
        return float(np.mean(list(values)))

    return Result(loader, layout.name, setting, held,
                  mean(displacement(o) for o in orders), mean(spearman(o) for o in orders),
                  mean(batch_spread(o) for o in orders),
                  mean(same_source_pairs(o, layout.source) for o in orders))


# --- the settings -----------------------------------------------------------------------------


def tar_results(layout: Layout, samples: int, epochs: int) -> list[Result]:
    results = []
    for buffer in TAR_BUFFERS:
        what = f"aioloader TarShards, {layout.name}, buffer {buffer}"
        dataset = aioloader.TarShards(layout.urls, shuffle_buffer=buffer)
        orders = aioloader_orders(dataset, "idx", samples, True, epochs, what)
        results.append(measure(orders, layout, "aioloader TarShards", f"buffer {buffer}",
                               min(buffer, samples)))
    orders = webdataset_orders(layout, samples, epochs)
    setting = f"shardshuffle={WEBDATASET_SHARD_SHUFFLE}, .shuffle({WEBDATASET_BUFFER})"
    results.append(measure(orders, layout, "WebDataset", setting,
                           min(WEBDATASET_BUFFER, samples)))
    return results


def parquet_results(layout: Layout, samples: int, epochs: int) -> list[Result]:
    group_rows = max(samples // ROW_GROUPS, 1)
    results = []
    for window in PARQUET_WINDOWS:
        what = f"aioloader Parquet, window {window}"
        dataset = aioloader.Parquet(layout.urls, ["position"], shuffle_window=window)
        orders = aioloader_orders(dataset, "position", samples, True, epochs, what)
        results.append(measure(orders, layout, "aioloader Parquet", f"window {window}",
                               min(window * group_rows, samples)))
    return results


def reference_results(layout: Layout, samples: int, epochs: int) -> list[Result]:
    """The two ends: uniform permutations, and aioloader reading the shards in order."""
    uniform = [np.random.default_rng([SEED, e]).permutation(samples).astype(np.int64)
               for e in range(epochs)]
    dataset = aioloader.TarShards(layout.urls, shuffle_buffer=0)
    unshuffled = aioloader_orders(dataset, "idx", samples, False, 1, "no shuffle")
    return [
        measure(uniform, layout, "uniform permutation", "reference", -1),
        measure(unshuffled, layout, "no shuffle", "shuffle=False", 0),
    ]


# --- report ---------------------------------------------------------------------------------


def memory_text(held: int, sample_kib: float) -> str:
    if held < 0:
        return "random access: 1 request/sample"
    size = held * sample_kib * 1024
    unit, scale = ("GiB", 1 << 30) if size >= 1 << 30 else ("MiB", 1 << 20)
    return f"{held:>7,} samples = {size / scale:6.1f} {unit}"


def print_table(results: list[Result], samples: int, epochs: int, sample_kib: float) -> None:
    print(f"\n{samples:,} samples, batches of {BATCH}, seed {SEED}; measures are means over "
          f"{epochs} epoch(s) per setting.")
    print("displacement and batch spread: 1.0 = uniform; Spearman: 0 = uniform, 1 = unshuffled;")
    print("same-source pairs: x a uniform permutation's, for the layout (1.0 = uniform).\n")
    header = (f"{'loader':<21} {'layout':<20} {'setting':<32} {'displ.':>6} {'rho':>6} "
              f"{'spread':>6} {'same-src':>8}  held for shuffling (at {sample_kib:g} KiB/sample)")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.loader:<21} {r.layout:<20} {r.setting:<32} {r.displacement:6.3f} "
              f"{r.spearman:6.3f} {r.spread:6.3f} {r.same_source:8.2f}  "
              f"{memory_text(r.held, sample_kib)}")
    print("\nOn top of what is held for shuffling, each reader holds what it reads ahead:")
    print("  aioloader TarShards: 2 shards downloading, up to 64 samples queued from each;")
    print("  aioloader Parquet: 4 row groups read ahead (row_groups_ahead=4), decoded;")
    print("  WebDataset: one shard open; its buffer starts yielding once it holds 100 samples.")
    print("WebDataset is read in this process without a DataLoader; under a DataLoader each")
    print("worker reads its own shards through its own buffer and each batch comes from one")
    print("worker, so a batch mixes no more than measured here.")


def plot(results: list[Result], samples: int, epochs: int) -> None:
    """Quality against samples held for shuffling: a line per aioloader dataset and layout, a
    square per WebDataset layout (same colour as its layout), a cross for no shuffle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("same_source", "same-source pairs in a batch\n(x uniform; 1 = uniform)", True),
              ("spread", "batch spread (1 = uniform)", False),
              ("displacement", "displacement (1 = uniform)", False)]
    colours = {layout: f"C{i}" for i, layout in enumerate(dict.fromkeys(r.layout for r in results))}
    series: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        if r.loader != "uniform permutation":
            series.setdefault((r.loader, r.layout), []).append(r)
    figure, axes = plt.subplots(1, len(panels), figsize=(15, 4.8))
    for axis, (field, label, log) in zip(axes, panels, strict=True):
        for (loader, layout), points in series.items():
            style = {"no shuffle": dict(marker="x", color="black", linestyle="none", ms=9),
                     "WebDataset": dict(marker="s", color=colours[layout], linestyle="none",
                                        ms=8)}.get(loader, dict(marker="o", color=colours[layout]))
            name = loader if loader == "no shuffle" else f"{loader}, {layout}"
            axis.plot([p.held for p in points], [getattr(p, field) for p in points],
                      label=name, **style)
        axis.axhline(1.0, color="black", linestyle="--", label="uniform permutation")
        axis.set_xscale("symlog", linthresh=100)
        right = max(r.held for r in results) * 1.5
        ticks = [t for t in (0, 100, 1000, 10_000, 100_000, 1_000_000) if t <= right]
        axis.set_xticks(ticks, [f"{t:,}" for t in ticks])
        axis.set_xlim(-20, right)  # room for the points at 0
        axis.set_xlabel("samples held for shuffling (buffer, or window rows)")
        axis.set_ylabel(label)
        if log:
            axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(f"Shuffle quality of streamed epochs: {samples:,} samples, batches of "
                    f"{BATCH}, mean of {epochs} epoch(s)")
    figure.tight_layout()
    FIGURE.parent.mkdir(exist_ok=True)
    figure.savefig(FIGURE, dpi=120)
    print(f"\nfigure: {FIGURE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--small", action="store_true", help="10,000 samples, 1 epoch")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs per setting, measures averaged (default 3; 1 with --small)")
    parser.add_argument("--sample-kib", type=float, default=100.0,
                        help="nominal sample size for the memory column (default: a JPEG)")
    args = parser.parse_args()
    samples = 10_000 if args.small else args.samples
    epochs = args.epochs or (1 if args.small else 3)

    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        tar_layouts = [write_tar_shards(work / f"tar{s}", samples, s) for s in TAR_SHARD_COUNTS]
        parquet = write_parquet(work / "parquet", samples)
        results = reference_results(tar_layouts[0], samples, epochs)
        for layout in tar_layouts:
            results += tar_results(layout, samples, epochs)
        results += parquet_results(parquet, samples, epochs)
    print_table(results, samples, epochs, args.sample_kib)
    plot(results, samples, epochs)


if __name__ == "__main__":
    main()
