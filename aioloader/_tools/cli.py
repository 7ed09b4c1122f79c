"""The `aioloader` command: demo, serve, bench, pack, inspect (thin layers over the library).

A user's mistake (a missing file, an unknown format, a bad value, a missing extra) ends in one
line on stderr, `aioloader: error: ...`, and exit status 2, as argparse's own errors do; other
exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from .. import __version__
from .._datasets.streaming import expand_braces
from .._errors import LoaderError
from .._loopthread import new_event_loop
from ..storage._storage import check_url, local_path
from ..testing import CONTROL_TOKEN_VARIABLE, Faults, serve

USER_ERRORS = (LoaderError, ValueError, OSError, ImportError)
"""What the library raises for bad input, unreadable data or a missing optional dependency."""

DESCRIPTION = (
    "An asyncio data loader for training on slow storage. Start with `aioloader demo`; "
    "`aioloader COMMAND --help` describes a command."
)

FAULT_HELP = {
    "latency_ms": "delay before every answer, in milliseconds",
    "error_rate": "fraction of requests answered 503",
    "retry_after": "seconds sent in Retry-After with those 503s (default: none sent)",
    "throttle_rate": "fraction of requests answered 429 with Retry-After: 0",
    "drop_rate": "fraction of requests whose connection is cut after half of the body",
    "stall_rate": "fraction of requests held for --stall-seconds before the answer",
    "stall_seconds": "how long a stalled request is held",
    "seed": "seed of the random choice of faulty requests",
    "ignore_ranges": "ignore Range headers: answer 200 with the whole file",
    "shift_ranges": "206 answers start this many bytes after the range asked",
    "no_etag": "send Last-Modified but no ETag (as Python's http.server)",
    "content_encoding": "Content-Encoding sent with every file; gzip and deflate also encode "
    "(default: none)",
}


def bounded_int(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [minimum, maximum], else a usage error saying so."""
    what = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


positive_int = bounded_int(1)
non_negative_int = bounded_int(0)


def positive_float(text: str) -> float:
    return _float_at_least(text, 0.0, strictly=True)


def non_negative_float(text: str) -> float:
    return _float_at_least(text, 0.0, strictly=False)


def _float_at_least(text: str, minimum: float, strictly: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > minimum if strictly else value >= minimum) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be {'>' if strictly else '>='} {minimum:g}, "
                                         f"got {text}")
    return value


def existing_path(text: str) -> Path:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return Path(text)


def existing_folder(text: str) -> Path:
    if not existing_path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a folder")
    return Path(text)


def url(text: str) -> str:
    """A local path (which must exist), file://, http(s):// or s3:// URL, or a brace pattern of
    them (`train-{000..009}.tar`), kept as text: a Path would turn `http://host/x` into the
    local path `http:/host/x`."""
    for one in expand_braces(text):
        try:
            check_url(one)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        local = local_path(one)
        if local is not None and not Path(local).exists():
            raise argparse.ArgumentTypeError(f"{one}: no such file")
    return text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where the help already says what it is (options
    whose default is None): "(default: None)" would tell a user nothing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    formatter = HelpFormatter
    parser = argparse.ArgumentParser(prog="aioloader", description=DESCRIPTION,
                                     formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str, run: Callable[[argparse.Namespace], None],
                description: str | None = None) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=description or summary,
                                  formatter_class=formatter)
        sub.set_defaults(run=run)
        return sub

    demo = command(
        "demo", "the headline and an image pipeline, over a local server with latency", _demo,
        "Serves small objects, then JPEGs, from a local test server that waits before every "
        "answer (as a remote store does) and loads them with aioloader and with one read in "
        "flight per worker process (as PyTorch's DataLoader), printing both rates. Needs "
        "aioloader[image] for the image part.",
    )
    demo.add_argument("--objects", type=positive_int, default=8000,
                      help="small objects aioloader reads in the first part")
    demo.add_argument("--baseline-objects", type=positive_int, default=300,
                      help="small objects the one-read-per-worker loader reads (it is slow)")
    demo.add_argument("--object-kib", type=positive_int, default=4, help="size of an object")
    demo.add_argument("--images", type=positive_int, default=512,
                      help="JPEGs aioloader reads in the second part")
    demo.add_argument("--baseline-images", type=positive_int, default=128,
                      help="JPEGs the one-read-per-worker loader reads")
    demo.add_argument("--latency-ms", type=non_negative_float, default=20.0,
                      help="server latency per request")
    demo.add_argument("--num-workers", type=positive_int, default=2,
                      help="decode processes of aioloader, worker processes of the baseline")
    demo.add_argument("--concurrency", type=positive_int, default=256,
                      help="aioloader's reads in flight")
    demo.add_argument("--cache-dir", type=Path, default=None,
                      help="where the generated data is kept (default: ~/.cache/aioloader)")

    serve_cmd = command(
        "serve", "serve a folder over HTTP, with latency and faults", _serve,
        "Serves the files under ROOT (Range requests too) until Ctrl-C. POST /_control "
        "changes the faults; it needs the control token: the environment variable "
        f"{CONTROL_TOKEN_VARIABLE}, or else a random one the server prints.",
    )
    serve_cmd.add_argument("root", type=existing_folder, help="the folder to serve")
    serve_cmd.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve_cmd.add_argument("--port", type=bounded_int(0, 65535), default=8000,
                           help="port to listen on; 0 picks a free one")
    for field in dataclasses.fields(Faults):
        flag = f"--{field.name.replace('_', '-')}"
        hint = FAULT_HELP.get(field.name, field.name.replace("_", " "))
        if field.type == "bool":
            serve_cmd.add_argument(flag, action="store_true", help=hint)
        else:
            kind = {"int": int, "str": str}.get(str(field.type), float)
            serve_cmd.add_argument(flag, type=kind, default=field.default, help=hint)

    pack = command(
        "pack", "pack an image folder or an im2rec .lst into .rec, tar shards or .tfrecord",
        _pack,
        "Packs images into OUT.rec plus OUT.idx (MXNet RecordIO), into WebDataset tar "
        "shards OUT-000000.tar, ..., or into OUT.tfrecord plus OUT.tfrecord.idx "
        "(tf.train.Example records: image/encoded, image/format, image/class/label). "
        "Records are shuffled with --seed (as im2rec does) so that "
        "early batches hold every class; a record's id (tar key) is the image's position in "
        "the sorted folder listing, or its index in the .lst. Output is written under "
        "temporary names and renamed once complete.",
    )
    pack.add_argument("source", type=existing_path,
                      help="a folder with a sub-folder per class, or an im2rec .lst file")
    pack.add_argument("out", type=Path, help="OUT.rec (plus OUT.idx), OUT.tar for shards, or "
                      "OUT.tfrecord (plus OUT.tfrecord.idx)")
    pack.add_argument("--format", choices=["rec", "tar", "tfrecord"], default=None,
                      help="output format (default: from the suffix of OUT)")
    pack.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                      help="shuffle the records; --no-shuffle keeps the input order")
    pack.add_argument("--seed", type=int, default=0, help="seed of the shuffle")
    pack.add_argument("--processes", type=positive_int, default=2,
                      help="processes that resize and re-encode")
    pack.add_argument("--resize", type=positive_int, default=None,
                      help="resize so the shorter edge has this many pixels (default: keep)")
    pack.add_argument("--quality", type=bounded_int(1, 100), default=None,
                      help="re-encode as JPEG at this quality (default: keep the bytes, or 95 "
                      "when resizing)")
    pack.add_argument("--shard-mb", type=positive_float, default=256.0,
                      help="target size of a tar shard in MB")

    inspect = command("inspect", "counts, sizes and labels of a .rec, .tar or .tfrecord",
                      _inspect)
    inspect.add_argument("file", type=url,
                         help="a .rec (its .idx is used when beside it), .tar shards (brace "
                         "patterns allowed; .tar.gz too) or a .tfrecord: a local path, "
                         "http(s):// or s3:// URL")
    inspect.add_argument("--first", type=non_negative_int, default=5,
                         help="records to show")

    bench = command(
        "bench", "read data as fast as possible; say what bounds it", _bench,
        "Reads a dataset flat out with a trivial decode and prints samples/s per epoch, the "
        "loader's stage figures and what bounds it (storage, decode or the consumer).",
    )
    bench.add_argument("urls", nargs="+", help="objects, or a .rec (with .idx beside it), or "
                       ".tar shards (brace patterns allowed); @FILE reads URLs from FILE")
    bench.add_argument("--epochs", type=positive_int, default=1, help="passes over the data")
    bench.add_argument("--batch-size", type=positive_int, default=64, help="samples per batch")
    bench.add_argument("--concurrency", type=positive_int, default=64, help="reads in flight")
    bench.add_argument("--num-workers", type=non_negative_int, default=2,
                       help="decode processes; 0 decodes in the main process")
    bench.add_argument("--timeline", type=Path, default=None,
                       help="write the timeline PNG here; needs aioloader[plot] (default: none)")

    images = command("make-images", "write demo JPEGs, a sub-folder per class (needs "
                     "aioloader[image])", _make_images)
    images.add_argument("folder", type=Path, help="where to write them (made if missing)")
    images.add_argument("--count", type=positive_int, default=1000, help="how many")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below
    except BrokenPipeError:  # `aioloader inspect x.rec | head`: stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except USER_ERRORS as e:
        parser.exit(2, f"{parser.prog}: error: {one_line(e)}\n")
    except KeyboardInterrupt:
        sys.exit(130)  # as a shell reports a command ended by Ctrl-C; no traceback


def one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return " ".join(str(error).split()) or type(error).__name__


def _demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    run_demo(objects=args.objects, baseline_objects=args.baseline_objects,
             object_kib=args.object_kib, images=args.images,
             baseline_images=args.baseline_images, latency_ms=args.latency_ms,
             num_workers=args.num_workers, concurrency=args.concurrency,
             cache_dir=args.cache_dir)


def _serve(args: argparse.Namespace) -> None:
    faults = Faults(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Faults)})
    run_until_interrupted(serve(args.root, args.host, args.port, faults))


def run_until_interrupted(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run `coroutine` in a new event loop; Ctrl-C cancels it, so its cleanup runs and then
    KeyboardInterrupt is raised (a KeyboardInterrupt raised in the loop instead would leave it
    pending, and Python warns when it is collected)."""
    loop = new_event_loop()
    task = loop.create_task(coroutine)
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
        with contextlib.suppress(NotImplementedError):  # Windows: no loop signal handlers
            loop.add_signal_handler(signal.SIGINT, interrupt)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        if not interrupted:
            raise
    finally:
        loop.close()
    if interrupted:
        raise KeyboardInterrupt


def _pack(args: argparse.Namespace) -> None:
    from .packing import FORMATS, ImageOptions, pack_recordio, pack_tar, pack_tfrecord

    kind = args.format or FORMATS.get(args.out.suffix.lower())
    if kind is None:
        raise ValueError(f"cannot tell the format of {args.out} from its suffix: name it .rec, "
                         ".tar or .tfrecord, or give --format rec, tar or tfrecord")
    options = ImageOptions(args.resize, args.quality)
    if kind == "tar":
        shards = pack_tar(args.source, args.out, options, args.processes,
                          int(args.shard_mb * (1 << 20)), args.shuffle, args.seed)
        print(f"wrote {len(shards)} shards: {shards[0]} .. {shards[-1]}")
    elif kind == "tfrecord":
        count = pack_tfrecord(args.source, args.out, options, args.processes, args.shuffle,
                              args.seed)
        print(f"wrote {count} records to {args.out} and its index {args.out}.idx")
    else:
        count = pack_recordio(args.source, args.out, options, args.processes, args.shuffle,
                              args.seed)
        print(f"wrote {count} records to {args.out} and {args.out.with_suffix('.idx')}")


def _make_images(args: argparse.Namespace) -> None:
    from .images import make_images

    made = make_images(args.folder, args.count, by_class=True)
    print(f"{len(made)} JPEGs in {args.folder}")


def _bench(args: argparse.Namespace) -> None:
    from .bench import bench

    bench(args.urls, args.epochs, args.batch_size, args.concurrency, args.num_workers,
          args.timeline)


def _inspect(args: argparse.Namespace) -> None:
    from .summary import summarize

    print(summarize(args.file, args.first))
