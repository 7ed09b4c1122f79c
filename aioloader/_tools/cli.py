"""The `aioloader` command: demo, serve, bench, pack, inspect (thin layers over the library)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path

from .._loopthread import new_event_loop
from ..testing import CONTROL_TOKEN_VARIABLE, Faults, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="aioloader", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="make a small image set, serve it slowly, load it")
    demo.add_argument("--images", type=int, default=1024, help="images to generate")
    demo.add_argument("--latency-ms", type=float, default=20.0, help="server latency per request")
    demo.add_argument("--num-workers", type=int, default=2, help="decode processes")
    demo.add_argument("--concurrency", type=int, default=64, help="reads in flight")
    demo.add_argument("--baseline-images", type=int, default=256,
                      help="images the one-read-per-worker baseline reads")
    demo.add_argument("--cache-dir", type=Path, default=None, help="where the images are kept")

    serve_cmd = commands.add_parser(
        "serve", help="serve a directory over HTTP with faults",
        description="POST /_control needs the control token: the environment variable "
        f"{CONTROL_TOKEN_VARIABLE}, or else a random one the server prints.",
    )
    serve_cmd.add_argument("root", type=Path)
    serve_cmd.add_argument("--host", default="127.0.0.1")
    serve_cmd.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    for field in dataclasses.fields(Faults):
        flag = f"--{field.name.replace('_', '-')}"
        if field.type == "bool":
            serve_cmd.add_argument(flag, action="store_true")
        else:
            kind = {"int": int, "str": str}.get(str(field.type), float)
            serve_cmd.add_argument(flag, type=kind, default=field.default)

    pack = commands.add_parser("pack", help="pack an image folder or .lst into .rec or tar shards")
    pack.add_argument("source", type=Path, help="folder with a sub-folder per class, or a .lst")
    pack.add_argument("out", type=Path, help="OUT.rec (plus OUT.idx), or OUT.tar for shards")
    pack.add_argument("--format", choices=["rec", "tar"], default=None,
                      help="default: from the suffix of OUT")
    pack.add_argument("--processes", type=int, default=2, help="worker processes")
    pack.add_argument("--resize", type=int, default=None, help="shorter edge in pixels")
    pack.add_argument("--quality", type=int, default=None, help="re-encode JPEG at this quality")
    pack.add_argument("--shard-mb", type=float, default=256.0, help="target tar shard size")

    inspect = commands.add_parser("inspect", help="counts, sizes and labels of a .rec or .tar")
    inspect.add_argument("file", type=Path)
    inspect.add_argument("--first", type=int, default=5, help="records to show")

    bench = commands.add_parser("bench", help="read data as fast as possible; say what bounds it")
    bench.add_argument("urls", nargs="+", help="objects, or a .rec (with .idx beside it), or "
                       ".tar shards (brace patterns allowed); @FILE reads URLs from FILE")
    bench.add_argument("--epochs", type=int, default=1)
    bench.add_argument("--batch-size", type=int, default=64)
    bench.add_argument("--concurrency", type=int, default=64)
    bench.add_argument("--num-workers", type=int, default=2)
    bench.add_argument("--timeline", type=Path, default=None, help="write the timeline PNG here")

    images = commands.add_parser("make-images", help="write demo JPEGs, a sub-folder per class")
    images.add_argument("folder", type=Path)
    images.add_argument("--count", type=int, default=1000)

    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            faults = Faults(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Faults)})
        except ValueError as e:
            serve_cmd.error(str(e))
        loop = new_event_loop()
        with contextlib.suppress(KeyboardInterrupt):
            loop.run_until_complete(serve(args.root, args.host, args.port, faults))
        loop.close()
    elif args.command == "pack":
        from .packing import ImageOptions, pack_recordio, pack_tar

        options = ImageOptions(args.resize, args.quality)
        if (args.format or args.out.suffix.lstrip(".")) == "tar":
            shards = pack_tar(args.source, args.out, options, args.processes,
                              int(args.shard_mb * (1 << 20)))
            print(f"wrote {len(shards)} shards: {shards[0]} .. {shards[-1]}")
        else:
            count = pack_recordio(args.source, args.out, options, args.processes)
            print(f"wrote {count} records to {args.out} and {args.out.with_suffix('.idx')}")
    elif args.command == "make-images":
        from .demo import make_images

        made = make_images(args.folder, args.count, by_class=True)
        print(f"{len(made)} JPEGs in {args.folder}")
    elif args.command == "bench":
        from .bench import bench as run_bench

        run_bench(args.urls, args.epochs, args.batch_size, args.concurrency, args.num_workers,
                  args.timeline)
    elif args.command == "inspect":
        from .summary import summarize

        print(summarize(args.file, args.first))
    elif args.command == "demo":
        from .demo import run_demo

        run_demo(
            images=args.images,
            latency_ms=args.latency_ms,
            num_workers=args.num_workers,
            concurrency=args.concurrency,
            baseline_images=args.baseline_images,
            cache_dir=args.cache_dir,
        )
