"""aioloader against the streaming loaders it is compared with, and PyTorch's DataLoader, all
reading one S3 bucket through a proxy that adds latency. Run by hand; all figures come from one
run.

    python benchmarks/peers.py [--images 4000] [--latency-ms 20] [--only NAME,...]

The same JPEGs (500x375, quality 90, made once and cached) in each loader's native format,
written by its own writer and uploaded to moto's S3 server on 127.0.0.1. A proxy in front of it
(benchmarks/peers_s3.py) adds a first-byte latency to every request, answers GETs of the
uploaded bodies from the local files (moto costs ~3 ms of CPU per GET: one-object-per-sample
rows would measure moto) and counts requests. Every loader runs the same decode and augment
(`aioloader._tools.images.decode_and_augment`: JPEG decode, random resized crop 224, flip, float32
normalise), in 2 processes, batch 64, shuffle on, persistent workers, each loader in a fresh
process of its own; LitData's and Mosaic's local caches live in a temporary folder that is
emptied before epoch 1 and kept for epoch 2, as they are designed to be used.

Reported per loader: samples/s in epochs 1 and 2; time to the first batch (building the
dataset and loader, plus epoch 1's first batch); CPU seconds per sample of the loader's own
process tree (psutil: its process and every process under it, live or reaped; the proxy and
moto are not in it and are reported apart as "server"); requests and bytes per epoch from the
proxy's counters. The ceiling is the decode alone in one process over JPEG bytes in memory,
times 2 for 2 cores.

Set-up, in a virtual environment of its own outside the repository (the peers pull in a lot;
the exact commands and versions are in benchmarks/peers-requirements.txt):

    python3 -m venv PEERS_VENV && . PEERS_VENV/bin/activate
    pip install torch==2.13.0          # first, alone: the CPU build; another version is GBs
    echo torch==2.13.0 > constraints.txt
    pip install -c constraints.txt -r benchmarks/peers-requirements.txt
    pip uninstall -y torchvision       # a CUDA build that fails to import beside CPU torch
    pip install -c constraints.txt -e '.[s3,image]'
    python benchmarks/peers.py --images 200 --only aioloader-files,webdataset   # a smoke run

WebDataset needs the curl command. What each peer needed in order to run here is printed with
the results (and kept in LOADERS in benchmarks/peers_loaders.py): LitData's obstore client gets
allow_http through a module constant, Mosaic's package is imported without its torchvision
parts and its parent boto3 client is dropped before the fork, WebDataset reads unsigned http://
URLs. Loaders (for --only): aioloader-tar, aioloader-recordio, aioloader-files, litdata,
litdata-raw, mosaic, webdataset, dataloader.

Read the figures with CAVEATS (printed with them) in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from peers_formats import WRITERS, Images, files_of, load_images, shard_bytes
from peers_loaders import BATCH, LOADERS, WORKERS, Plan, ceiling
from peers_loaders import main as run_in_this_process
from peers_s3 import Servers, upload

from aioloader._tools.demo import default_cache_dir

BUCKET = "bench"
HERE = Path(__file__).resolve().parent
CAVEATS = """\
  - epoch 2: LitData and Mosaic read their local disk caches (0 requests); aioloader (whose disk
    cache, Loader(cache_dir=), is off here) and WebDataset read the bucket again
  - latency only: no bandwidth limit, plain HTTP (no TLS), signatures not checked (WebDataset's
    URLs are unsigned; the others pay for signing); real S3 costs more per request and per byte
  - the proxy and moto share the 2 cores with the loader (srv1); per-object rows load them most
  - aioloader forks its decode processes from a helper it starts once per interpreter (about
    0.3 s, counted in epoch 1); DataLoader workers fork from the warm parent
  - shuffling differs: full permutations (per-object, RecordIO), shard order + 1000 samples
    (aioloader tar: windows of 1000 consecutive samples, read whole, the first batch's apart first;
    WebDataset: a buffer per worker, giving samples once it holds 100), chunk-wise (LitData),
    block-wise (Mosaic); WebDataset gives each worker whole
    shards, so a few shards make its epoch end lopsided"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--tail-rate", type=float, default=0.0,
                        help="fraction of requests delayed by --tail-seconds more")
    parser.add_argument("--tail-seconds", type=float, default=1.0)
    parser.add_argument("--only", default="", help="comma-separated loader names")
    parser.add_argument("--shard-mb", type=float, default=12.0,
                        help="shard size; smaller when the data would make fewer than 4")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="aioloader's reads in flight (its default)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per loader")
    parser.add_argument("--cache", type=Path, default=default_cache_dir(),
                        help="where the generated JPEGs are kept between runs")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--worker", nargs=3, metavar=("NAME", "PLAN", "OUT"),
                        help=argparse.SUPPRESS)
    return parser.parse_args()


def chosen(only: str) -> list[str]:
    names = [n.strip() for n in only.split(",") if n.strip()] or list(LOADERS)
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        raise SystemExit(f"unknown loader(s) {unknown}; choose from {list(LOADERS)}")
    return names


def write_formats(images: Images, folders: set[str], work: Path, size: int) -> dict[str, Path]:
    """Each needed format into work/<folder>; `files` is the JPEG folder itself."""
    where = {}
    for folder in sorted(folders):
        if folder == "files":
            where[folder] = images.folder
            continue
        print(f"writing {folder} ...", flush=True)
        WRITERS[folder](images, work / folder, size)
        where[folder] = work / folder
    return where


def objects_of(folder: str, local: Path, images: Images) -> list[tuple[str, Path]]:
    """(key, file) to upload for one bucket folder."""
    if folder == "files":
        return [(f"files/{name}", images.folder / name) for name in images.names]
    return [(f"{folder}/{p.relative_to(local).as_posix()}", p) for p in files_of(local)]


def shard_summary(objects: list[tuple[str, Path]]) -> str:
    sizes = [p.stat().st_size for k, p in objects
             if not k.endswith((".json", ".idx")) and not k.startswith("files/")]
    if not sizes:
        return f"{len(objects)} objects"
    return f"{len(sizes)} shards of {sum(sizes) / len(sizes) / 1e6:.1f} MB"


def run_loader(name: str, plan: Plan, work: Path, servers: Servers,
               timeout: float) -> dict[str, Any]:
    """The loader in a fresh process of its own; its figures, or {"error": ...}."""
    plan_path, out, log = (work / f"{name}.{kind}" for kind in ("plan.json", "out.json", "log"))
    plan_path.write_text(json.dumps(asdict(plan)))
    env = {**os.environ, **servers.environment(),
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.update({k: v.format(endpoint=servers.endpoint) for k, v in LOADERS[name].env.items()})
    command = [sys.executable, __file__, "--worker", name, str(plan_path), str(out)]
    with open(log, "w") as sink:
        process = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"error": f"timed out after {timeout:.0f} s"}
    if process.returncode != 0 or not out.exists():
        lines = log.read_text(errors="replace").strip().splitlines()
        errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception)\b", line)]
        reason = (errors or [line for line in lines if line.strip()] or ["no output"])[-1]
        return {"error": reason[:300], "log": lines[-30:]}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def row_figures(result: dict[str, Any], ceiling_rate: float) -> dict[str, float]:
    """The table's numbers for one loader."""
    setup, first, second = result["setup"], *result["epochs"]
    figures = {"setup": setup["seconds"], "ttfb": setup["seconds"] + (first["first_batch"] or 0)}
    for n, epoch in ((1, first), (2, second)):
        figures[f"rate{n}"] = epoch["samples"] / epoch["seconds"]
        figures[f"cpu{n}"] = epoch["cpu"] / epoch["samples"] * 1e3
        figures[f"server{n}"] = epoch["server_cpu"] / epoch["samples"] * 1e3
        figures[f"requests{n}"] = sum(epoch["requests"].values())
        figures[f"mb{n}"] = epoch["bytes"] / 1e6
        figures[f"share{n}"] = figures[f"rate{n}"] / ceiling_rate
    figures["requests0"] = sum(setup["requests"].values())
    return figures


COLUMNS = [  # (heading, figure, format)
    ("ep1/s", "rate1", "{:.0f}"), ("ep2/s", "rate2", "{:.0f}"),
    ("ceil1", "share1", "{:.0%}"), ("ceil2", "share2", "{:.0%}"),
    ("1st s", "ttfb", "{:.1f}"), ("setup", "setup", "{:.1f}"),
    ("cpu1", "cpu1", "{:.2f}"), ("cpu2", "cpu2", "{:.2f}"), ("srv1", "server1", "{:.2f}"),
    ("req0", "requests0", "{:.0f}"), ("req1", "requests1", "{:.0f}"),
    ("req2", "requests2", "{:.0f}"), ("MB1", "mb1", "{:.0f}"), ("MB2", "mb2", "{:.0f}"),
]
WIDTH = 6
LEGEND = """\
  ep1/s, ep2/s  samples/s in epoch 1 (local caches empty) and epoch 2
  ceil1, ceil2  that as a share of the 2-core ceiling
  1st s, setup  seconds to the first batch (from building the dataset); of which building it
  cpu1, cpu2    CPU ms per sample of the loader's process tree (its process and all under it)
  srv1          CPU ms per sample of the proxy and moto in epoch 1 (not in cpu1)
  req0-2, MB1-2 requests through the proxy in set-up, epoch 1, epoch 2; MB it sent per epoch"""


def format_row(title: str, figures: dict[str, float]) -> str:
    return f"{title:<34}" + "".join(fmt.format(figures[key]).rjust(WIDTH)
                                    for _, key, fmt in COLUMNS)


def header() -> str:
    return f"{'loader':<34}" + "".join(heading.rjust(WIDTH) for heading, _, _ in COLUMNS)


def best(rows: dict[str, dict[str, float]], family: str, key: str,
         low: bool = False) -> tuple[str, float] | None:
    """The (name, value) of the family's best row for `key`: highest, or lowest if `low`."""
    candidates = [(n, f[key]) for n, f in rows.items() if LOADERS[n].family == family]
    if not candidates:
        return None
    return (min if low else max)(candidates, key=lambda item: item[1])


def print_ratios(rows: dict[str, dict[str, float]]) -> None:
    """Best aioloader row against best peer row, metric by metric (the rows are named)."""
    print("\nratios, aioloader / peer, each side's best row for that figure (for CPU and time, "
          "below 1 favours aioloader):")
    for label, key, low in (("epoch 1 samples/s", "rate1", False),
                            ("epoch 2 samples/s", "rate2", False),
                            ("CPU per sample, epoch 1", "cpu1", True),
                            ("CPU per sample, epoch 2", "cpu2", True),
                            ("time to first batch", "ttfb", True)):
        ours, theirs = best(rows, "aioloader", key, low), best(rows, "peer", key, low)
        if ours and theirs:
            print(f"  {label:<26} {ours[1] / theirs[1]:5.2f}x  "
                  f"({ours[0]} {ours[1]:.4g} vs {theirs[0]} {theirs[1]:.4g})")
    if "aioloader-files" in rows and "litdata-raw" in rows:
        a, b = rows["aioloader-files"], rows["litdata-raw"]
        print(f"  one object per sample, aioloader-files / litdata-raw: epoch 1 "
              f"{a['rate1'] / b['rate1']:.2f}x, epoch 2 {a['rate2'] / b['rate2']:.2f}x; "
              f"CPU/sample {a['cpu1'] / b['cpu1']:.2f}x, {a['cpu2'] / b['cpu2']:.2f}x")


def print_checks(results: dict[str, dict[str, Any]], labels: list[int]) -> None:
    """Epochs that did not hand out each sample once (by count and sum of labels)."""
    expected = (len(labels), sum(labels))
    odd = {name: [(e["samples"], e["label_sum"]) for e in result["epochs"]]
           for name, result in results.items() if "error" not in result}
    odd = {name: epochs for name, epochs in odd.items() if any(e != expected for e in epochs)}
    print(f"\nepochs that did not give {expected[0]} samples with labels summing to "
          f"{expected[1]}: " + ("none" if not odd else ""))
    for name, epochs in odd.items():
        print(f"  {name}: " + ", ".join(f"{n} samples, sum {total}" for n, total in epochs))


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]], top: dict[str, float],
           layout: dict[str, str], labels: list[int]) -> None:
    ceiling_rate, count = 2 * top["rate"], len(labels)
    print(f"\n{count} JPEGs 500x375 q90; decode + random resized crop 224 + flip + normalise; "
          f"batch {BATCH}, {WORKERS} processes, shuffled; S3 (moto) behind a proxy adding "
          f"{args.latency_ms:g} ms per request"
          + (f", {args.tail_rate:.1%} of requests +{args.tail_seconds:g} s" if args.tail_rate
             else ""))
    print(f"ceiling: decode alone in one process {top['rate']:.0f} samples/s "
          f"({top['cpu'] * 1e3:.2f} ms CPU/sample); 2 cores: {ceiling_rate:.0f} samples/s")
    if top["rate"] * top["cpu"] < 0.85:
        print(f"  note: the decode had only {top['rate'] * top['cpu']:.0%} of a core; something "
              "else is using the machine, and every figure here is the less reliable for it")
    print(f"data: {'; '.join(f'{k} {v}' for k, v in sorted(layout.items()))}\n")
    print(header())
    rows = {}
    for name, result in results.items():
        if "error" in result:
            print(f"{LOADERS[name].title:<34} FAILED: {result['error']}")
            continue
        rows[name] = row_figures(result, ceiling_rate)
        print(format_row(LOADERS[name].title, rows[name]))
    print(LEGEND)
    print_ratios(rows)
    print_checks(results, labels)
    print("\nrequests by method: set-up | epoch 1 | epoch 2 (how many the proxy passed to moto)")
    for name, result in results.items():
        if "error" not in result:
            phases = [result["setup"], *result["epochs"]]
            print(f"  {name:<20} " + " | ".join(
                " ".join(f"{k} {v}" for k, v in sorted(p["requests"].items())) or "none"
                for p in phases) + f"  ({'/'.join(str(p['forwarded']) for p in phases)})")
    print("\nwhat each loader needed here:")
    for name in results:
        print(f"  {name:<20} {LOADERS[name].settings}")
    print("\ncaveats:\n" + CAVEATS)


def fill_bucket(servers: Servers, images: Images,
                local: dict[str, Path]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Upload every written format; (keys by folder, a line about each folder's shards)."""
    keys, layout = {}, {}
    for name, path in local.items():
        objects = objects_of(name, path, images)
        layout[name] = shard_summary(objects)
        print(f"uploading {name}: {layout[name]} ...", flush=True)
        upload(servers, BUCKET, objects)
        keys[name] = [key for key, _ in objects]
    return keys, layout


def run_all(names: list[str], plan: Plan, work: Path, servers: Servers,
            timeout: float) -> dict[str, dict[str, Any]]:
    """Each loader in turn, each with a cache folder of its own; a failure is kept, not raised."""
    results = {}
    for name in names:
        print(f"running {name} ...", flush=True)
        started = time.perf_counter()
        plan.cache = str(work / "cache" / name)
        results[name] = result = run_loader(name, plan, work, servers, timeout)
        print(f"  done in {time.perf_counter() - started:.0f} s", flush=True)
        if "error" in result:
            print("  FAILED; the end of its output:\n    " + "\n    ".join(result.get("log", [])))
    return results


def main() -> None:
    args = parse_args()
    if args.worker:
        run_in_this_process(*args.worker)
        return
    names = chosen(args.only)
    images = load_images(args.cache, args.images)
    top = ceiling([str(p) for p in images.paths()], images.labels)
    size = shard_bytes(images, int(args.shard_mb * 1e6))
    with tempfile.TemporaryDirectory(prefix="peers-") as folder:
        work = Path(folder)
        local = write_formats(images, {LOADERS[n].folder for n in names}, work / "data", size)
        with Servers(args.latency_ms, args.tail_rate, args.tail_seconds) as servers:
            keys, layout = fill_bucket(servers, images, local)
            plan = Plan(servers.endpoint, BUCKET, keys, "", servers.pids, args.concurrency)
            results = run_all(names, plan, work, servers, args.timeout)
    report(args, results, top, layout, images.labels)
    if args.json:
        args.json.write_text(json.dumps({"ceiling": top, "layout": layout,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
