"""Distributed training on CPU: `torchrun --nproc_per_node=2`, gloo, fed by aioloader over HTTP.

    python examples/distributed_digits.py --out results/

writes scikit-learn's handwritten digits (1797 8x8 images, shipped inside the package) as one
small file per sample, serves them with 10 ms latency from the project's test server on
127.0.0.1, and launches two ranks with torchrun. Each rank reads its share of every epoch through
aioloader (rank and world size come from torch.distributed), trains a small MLP with
DistributedDataParallel, and writes the sample indices it saw; rank 0 also writes the accuracy on
held-out digits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import aioloader

TRAIN = 1500  # the first 1500 digits train; the remaining 297 are held out


def decode_digit(raw: bytes) -> dict[str, object]:
    """File layout: index (u16), label (u8), 64 pixels (u8, 0..16)."""
    index = int.from_bytes(raw[:2], "little")
    pixels = np.frombuffer(raw, np.uint8, 64, offset=3).astype(np.float32) / 16
    return {"x": pixels, "y": raw[2], "index": index}


def write_digits(folder: Path) -> list[str]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    names = []
    for i in range(TRAIN):
        name = f"digit-{i:04d}.bin"
        body = digits.data[i].astype(np.uint8).tobytes()
        (folder / name).write_bytes(i.to_bytes(2, "little") + bytes([digits.target[i]]) + body)
        names.append(name)
    return names


def train(base_url: str, epochs: int, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from aioloader.torch import TorchLoader

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    urls = [f"{base_url}digit-{i:04d}.bin" for i in range(TRAIN)]
    loader = aioloader.Loader(aioloader.Files(urls), decode=decode_digit, batch_size=25,
                              shuffle=True, seed=1, concurrency=64, num_workers=1)
    seen: list[list[int]] = []
    with TorchLoader(loader) as batches:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            seen.append([])
            for batch in batches:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"].long())
                loss.backward()
                optimizer.step()
                seen[-1] += batch["index"].tolist()
    result: dict[str, object] = {"rank": rank, "world_size": dist.get_world_size(), "seen": seen}
    if rank == 0:
        from sklearn.datasets import load_digits

        digits = load_digits()
        with torch.no_grad():
            x = torch.tensor(digits.data[TRAIN:] / 16, dtype=torch.float32)
            predicted = model(x).argmax(1).numpy()
        result["accuracy"] = float((predicted == digits.target[TRAIN:]).mean())
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(out: Path, epochs: int) -> None:
    """Write the digits, serve them, and run two ranks under torchrun."""
    from aioloader.testing import TestServer

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        write_digits(Path(folder))
        with TestServer(folder, latency_ms=10) as server:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2", __file__,
                       "--url", server.url, "--epochs", str(epochs), "--out", str(out)]
            subprocess.run(command, check=True, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    print(f"accuracy on {1797 - TRAIN} held-out digits: {ranks[0]['accuracy']:.3f}")
    print("samples per rank per epoch:", [len(r["seen"][0]) for r in ranks])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("distributed-digits"))
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--url", help="set by the launcher: where the digits are served")
    args = parser.parse_args()
    if args.url:
        train(args.url, args.epochs, args.out)
    else:
        launch(args.out, args.epochs)


if __name__ == "__main__":
    main()
