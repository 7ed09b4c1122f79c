"""A slow tail: 1% of requests answered 1 s late. aioloader (with and without hedged reads)
against PyTorch's DataLoader, each compared with its own rate without the tail.

4,000 objects of 16 KiB on the project's test server (127.0.0.1, 20 ms per request), a trivial
decode (bytes to a uint8 array), batch 64, concurrency 128, 2 decode processes or workers. The
tail is the server's stall fault: 1% of requests, drawn at random, wait 1 s more.

Each loader runs epochs alternately without and with the tail (after a warm-up epoch), and the
figures are the medians of each: an epoch lasts about a second, and this machine's speed drifts
by more than the difference between runs made minutes apart. Compare the ratios.

    python benchmarks/tail_latency.py [--objects 4000] [--tail-rate 0.01] [--tail-seconds 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks_common import RequestsDataset, samples_per_second
from remote_latency import BATCH, trivial_decode, write_objects

import aioloader
from aioloader.testing import TestServer


def alternate(
    server: TestServer, epoch: Callable[[], Iterable[Any]], expected: int, pairs: int,
    tail: dict[str, float], name: str,
) -> dict[str, float]:
    """Median samples/s of `pairs` epochs without and `pairs` with the tail, alternating."""
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(pairs):
        for kind in ("without", "with"):
            server.set_faults(stall_rate=tail["rate"] if kind == "with" else 0.0,
                              stall_seconds=tail["seconds"])
            rates[kind].append(samples_per_second(epoch(), expected, f"{name}, {kind} tail"))
    return {kind: statistics.median(values) for kind, values in rates.items()}


def aioloader_rates(
    server: TestServer, urls: list[str], concurrency: int, hedge: bool, pairs: int,
    tail: dict[str, float],
) -> tuple[dict[str, float], str]:
    loader = aioloader.Loader(
        aioloader.Files(urls), decode=trivial_decode, batch_size=BATCH,
        concurrency=concurrency, num_workers=2, persistent_workers=True, hedge=hedge,
    )
    with loader:
        samples_per_second(loader, len(urls), "warm-up epoch")
        requests, hedges = loader.stats.requests, loader.stats.hedges
        rates = alternate(server, lambda: loader, len(urls), pairs, tail, f"aioloader {hedge=}")
        requests, hedges = loader.stats.requests - requests, loader.stats.hedges - hedges
    note = (f"{hedges} hedges over both conditions, {hedges / max(requests - hedges, 1):.1%} "
            "extra requests" if hedge else "")
    return rates, note


def torch_rates(server: TestServer, urls: list[str], tail: dict[str, float]) -> dict[str, float]:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(RequestsDataset(urls, trivial_decode),
                                         batch_size=BATCH, num_workers=2)
    return alternate(server, lambda: loader, len(urls), 2, tail, "DataLoader x2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=4_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--tail-rate", type=float, default=0.01)
    parser.add_argument("--tail-seconds", type=float, default=1.0)
    parser.add_argument("--pairs", type=int, default=6, help="epochs of each condition")
    parser.add_argument("--torch-objects", type=int, default=640,
                        help="objects the (slow) DataLoader epochs read; rate is per second anyway")
    args = parser.parse_args()
    tail = {"rate": args.tail_rate, "seconds": args.tail_seconds}

    rows: dict[str, dict[str, float]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        names = write_objects(Path(folder), args.objects)
        with TestServer(folder, latency_ms=args.latency_ms) as server:
            urls = [server.url + n for n in names]
            for hedge in (True, False):
                rates, note = aioloader_rates(server, urls, args.concurrency, hedge, args.pairs,
                                              tail)
                rows[f"aioloader, hedge={hedge}"] = rates
                if note:
                    notes.append(f"aioloader, hedge={hedge}: {note}")
            rows["PyTorch DataLoader, 2 workers"] = torch_rates(
                server, urls[: args.torch_objects], tail)

    print(f"\n{args.objects} objects x 16 KiB, {args.latency_ms:g} ms latency, batch {BATCH}, "
          f"concurrency {args.concurrency}, 2 processes; tail: {args.tail_rate:.0%} of requests "
          f"{args.tail_seconds:g} s late (test server on 127.0.0.1); medians of alternating "
          "epochs")
    print(f"  {'loader':<34} {'no tail':>9} {'tail':>9} {'tail / no tail':>15}")
    for name, rates in rows.items():
        print(f"  {name:<34} {rates['without']:9.0f} {rates['with']:9.0f} "
              f"{rates['with'] / rates['without']:15.2f}")
    for note in notes:
        print(f"  {note}")
    best = rows["aioloader, hedge=True"]
    torch = rows["PyTorch DataLoader, 2 workers"]
    print(f"  goal: aioloader with the tail >= 0.9x without it: "
          f"{best['with'] / best['without']:.2f}x; vs DataLoader under the tail: "
          f"{best['with'] / torch['with']:.1f}x")


if __name__ == "__main__":
    main()
