"""aioloader in three forms: async for, plain for, and PyTorch.

The decode function lives in this script, so the loop runs under `if __name__ == "__main__":`
(decode processes import this file, as PyTorch's spawned workers do).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import numpy as np

import aioloader
from aioloader.testing import TestServer


def decode(raw: bytes, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Runs in a decode process: bytes to an array, plus a random augmentation."""
    pixels = np.frombuffer(raw, dtype=np.uint8).astype(np.float32) / 255
    return {"pixels": pixels + rng.normal(0, 0.01, pixels.shape).astype(np.float32)}


async def train_async(loader: aioloader.Loader) -> None:
    async for batch in loader:
        print("async for:", batch["pixels"].shape)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        for i in range(256):
            Path(folder, f"{i:04d}.raw").write_bytes(np.random.default_rng(i).bytes(48))
        with TestServer(folder, latency_ms=20) as server:  # a slow HTTP server on 127.0.0.1
            urls = [f"{server.url}{i:04d}.raw" for i in range(256)]
            loader = aioloader.Loader(
                aioloader.Files(urls), decode=decode, batch_size=64, shuffle=True,
                concurrency=64, num_workers=2,
            )
            with loader:
                asyncio.run(train_async(loader))
                for batch in loader:
                    print("plain for:", batch["pixels"].shape)
                try:
                    from aioloader.torch import TorchLoader
                except ImportError:
                    return
                for batch in TorchLoader(loader):
                    print("torch:", type(batch["pixels"]).__name__, tuple(batch["pixels"].shape))
            print(loader.stats)


if __name__ == "__main__":
    main()
