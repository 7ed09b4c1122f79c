"""DDP on tar shards (or Parquet row groups, or TFRecord files) of uneven sizes, resumed on
another number of ranks.

    python examples/distributed_tar_shards.py --out results/ [--format parquet] [--service node]
        [--store s3]

writes scikit-learn's handwritten digits into 9 WebDataset tar shards of uneven sizes (or 9
Parquet files whose row groups are as uneven, or 9 TFRecord files of `tf.train.Example`s), serves
them from the project's test server on 127.0.0.1 (or, with `--store s3`, from moto's S3 server
there: the dev extra has it), and trains a small model with
DistributedDataParallel (gloo, CPU) under torchrun: two ranks for two epochs and part of a
third, where rank 0 saves a checkpoint (the model and `loader.state_dict()`); then three ranks
resume from it and finish. Every rank takes the same number of steps in every epoch (an epoch
divides by samples, not shards), and the resumed epoch skips nothing. Mid-epoch, rank 0 forks a
child that exits at once (as a checkpoint writer or a logging helper would): training goes on.
Each rank writes the samples it saw per epoch. With `--service node`, one loader service
serves every rank; with `--service none`, each rank runs its passes in its own process (else
each rank has a loader service of its own).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gzip
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

import aioloader

SHARDS = [300, 41, 250, 7, 410, 120, 3, 269, 100]
"""Digits per shard: 1500 in all."""


def decode_digit(sample: dict[str, Any]) -> dict[str, object]:
    """A sample's `.bin`: index (u16), label (u8), 64 pixels (u8, 0..16)."""
    raw = sample["bin"]
    pixels = np.frombuffer(raw, np.uint8, 64, offset=3).astype(np.float32) / 16
    return {"x": pixels, "y": raw[2], "index": int.from_bytes(raw[:2], "little")}


def decode_record(raw: bytes) -> dict[str, object]:
    """A TFRecord record: a `tf.train.Example` whose `bin` feature is the digit's bytes."""
    return decode_digit({"bin": aioloader.tfrecord.parse_example(raw)["bin"][0]})


def write_shards(folder: Path, format: str) -> list[str]:
    """Tar shards of SHARDS digits each, Parquet files with row groups of up to 64 rows, or
    TFRecord files."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    names, first = [], 0
    for n, count in enumerate(SHARDS):
        bodies = [i.to_bytes(2, "little") + bytes([digits.target[i]])
                  + digits.data[i].astype(np.uint8).tobytes() for i in range(first, first + count)]
        names.append(f"digits-{n:03d}.{format}")
        if format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"bin": bodies}), folder / names[-1], row_group_size=64)
        elif format.startswith("tfrecord"):
            with aioloader.tfrecord.Writer(folder / names[-1]) as writer:
                for body in bodies:
                    writer.write(aioloader.tfrecord.example({"bin": body}))
            if format.endswith(".gz"):  # as TensorFlow writes compression_type="GZIP"
                path = folder / names[-1]
                path.write_bytes(gzip.compress(path.read_bytes()))
        else:
            with tarfile.open(folder / names[-1], "w") as tar:
                for i, body in enumerate(bodies, first):
                    info = tarfile.TarInfo(f"digit-{i:04d}.bin")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        first += count
    return names


def train(urls: list[str], service: Literal["process", "node", "none"], epochs: int, out: Path,
          stop_after: int | None, resume: Path | None) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from aioloader.torch import TorchLoader

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    data: aioloader.Dataset | aioloader.Stream
    decode = decode_digit
    if urls[0].endswith(".parquet"):
        data = aioloader.Parquet(urls, shuffle_window=2)
    elif urls[0].endswith(".tfrecord"):
        data, decode = aioloader.TFRecord(urls), decode_record
    elif urls[0].endswith(".tfrecord.gz"):
        data, decode = aioloader.TFRecordStream(urls, shuffle_buffer=100), decode_record
    else:
        data = aioloader.TarShards(urls, shuffle_buffer=100)
    loader = aioloader.Loader(data, decode=decode, batch_size=16, shuffle=True, seed=1,
                              num_workers=1, service=None if service == "none" else service)
    loader.start()  # the service (the node's, joined) up before the first step
    first_epoch = 0
    if resume is not None:
        checkpoint = torch.load(resume)
        net.load_state_dict(checkpoint["model"])
        loader.load_state_dict(checkpoint["loader"])
        first_epoch = checkpoint["loader"]["epoch"]
    model = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: dict[int, list[int]] = {}
    with TorchLoader(loader) as batches:
        for epoch in range(first_epoch, epochs):
            loader.set_epoch(epoch)  # after load_state_dict: keeps the saved position
            seen[epoch] = []
            for step, batch in enumerate(batches, 1):
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"].long())
                loss.backward()  # all-reduces: a rank with fewer steps would hang or crash
                optimizer.step()
                seen[epoch] += batch["index"].tolist()
                if rank == 0 and epoch == first_epoch and step == 3:
                    fork_a_child_that_exits()
                if stop_after is not None and epoch == epochs - 1 and step == stop_after:
                    if rank == 0:
                        torch.save({"model": net.state_dict(), "loader": batches.state_dict()},
                                   out / "checkpoint.pt")
                    break
    result = {"rank": rank, "world_size": world_size, "seen": seen}
    (out / f"ranks-{world_size}-rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def fork_a_child_that_exits() -> None:
    """What a checkpoint writer or a logging helper does mid-epoch: the child's exit runs the
    Python finalizers it inherited (the loader's among them), which must leave the parent's
    loader alone. The child then ends with os._exit, not sys.exit: after a gloo process group,
    torch's own C++ teardown hangs in a forked child, with or without aioloader."""
    pid = os.fork()
    if pid == 0:
        atexit._run_exitfuncs()  # what sys.exit runs in Python, weakref finalizers included
        os._exit(0)
    os.waitpid(pid, 0)


@contextlib.contextmanager
def served_over_http(folder: Path) -> Iterator[str]:
    """The project's test server on the folder, 5 ms per request: the files' base URL."""
    from aioloader.testing import TestServer

    with TestServer(folder, latency_ms=5) as server:
        yield server.url


@contextlib.contextmanager
def served_over_s3(folder: Path) -> Iterator[str]:
    """The folder's files in a bucket of moto's S3 server on 127.0.0.1, which the ranks reach
    through the AWS_* variables they inherit: the files' base URL."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                   "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    os.environ.update(credentials)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        for _ in range(300):  # 30 s for the server to listen
            try:
                client.create_bucket(Bucket="digits")
                break
            except Exception:
                time.sleep(0.1)
        for path in sorted(folder.iterdir()):
            client.upload_file(str(path), "digits", path.name)
        yield "s3://digits/"
    finally:
        server.terminate()
        server.wait(10)


def torchrun(ranks: int, *arguments: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", __file__, *arguments]
    subprocess.run(command, check=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def launch(out: Path, format: str, service: str, store: str) -> None:
    """Two ranks for epochs 0, 1 and 6 steps of 2; three ranks resume and finish epoch 2."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        names = write_shards(Path(folder), format)
        with (served_over_s3 if store == "s3" else served_over_http)(Path(folder)) as base:
            urls = ",".join(base + name for name in names)
            common = ["--urls", urls, "--out", str(out), "--epochs", "3", "--service", service]
            torchrun(2, *common, "--stop-after", "6")
            torchrun(3, *common, "--resume", str(out / "checkpoint.pt"))
    for world_size in (2, 3):
        for rank in range(world_size):
            result = json.loads((out / f"ranks-{world_size}-rank-{rank}.json").read_text())
            counts = {epoch: len(seen) for epoch, seen in result["seen"].items()}
            print(f"{world_size} ranks, rank {rank}: samples per epoch {counts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("distributed-tar-shards"))
    parser.add_argument("--format", choices=["tar", "parquet", "tfrecord", "tfrecord.gz"],
                        default="tar")
    parser.add_argument("--service", choices=["process", "node", "none"], default="process",
                        help="a loader service per rank, one for the node's ranks, or none")
    parser.add_argument("--store", choices=["http", "s3"], default="http")
    parser.add_argument("--urls", help="set by the launcher: the shards, comma-separated")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    args = parser.parse_args()
    if args.urls:
        train(args.urls.split(","), args.service, args.epochs, args.out, args.stop_after,
              args.resume)
    else:
        launch(args.out, args.format, args.service, args.store)


if __name__ == "__main__":
    main()
