"""`Loader.start()`: what the first pass would start and wait for (the loader service, a
node's joined, and persistent decode processes with worker_init run), started before it."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import aioloader


class Numbers(aioloader.Dataset):
    def __len__(self) -> int:
        return 24

    async def fetch(self, index: int) -> int:
        return index


class MarkStarted:
    """worker_init: slow, as importing a model's code is, then leaves `<worker>-<pid>`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        time.sleep(0.3)
        (self.folder / f"{worker_id}-{os.getpid()}").touch()


def index_and_pid(index: int) -> tuple[int, int]:
    return index, os.getpid()


def _loader(folder: Path, service: str | None, **settings: Any) -> aioloader.Loader:
    return aioloader.Loader(Numbers(), decode=index_and_pid, batch_size=4, shuffle=True, seed=3,
                            num_workers=2, worker_init=MarkStarted(folder), service=service,
                            **settings)


@pytest.mark.parametrize("service", [None, "process", "node"])
def test_start_returns_with_every_decode_process_ready_and_the_pass_uses_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: str | None) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with _loader(tmp_path, service, persistent_workers=True) as loader:
        loader.start()
        started = sorted(path.name for path in tmp_path.iterdir())
        assert [name.split("-")[0] for name in started] == ["0", "1"]
        loader.start()  # again: nothing more
        batches = list(loader)
        assert sorted(path.name for path in tmp_path.iterdir()) == started
    decoded_in = {int(pid) for batch in batches for pid in batch[1]}
    assert decoded_in <= {int(name.split("-")[1]) for name in started}
    with aioloader.Loader(Numbers(), batch_size=4, shuffle=True, seed=3) as plain:
        assert [list(b[0]) for b in batches] == [list(b) for b in plain]
    with pytest.raises(aioloader.LoaderError, match="closed"):
        loader.start()


def test_start_leaves_a_passs_own_decode_processes_to_the_pass(tmp_path: Path) -> None:
    """Without persistent_workers each pass has decode processes of its own (seeded by its
    epoch, as DataLoader's): start() starts the service only."""
    with _loader(tmp_path, "process") as loader:
        loader.start()
        assert loader._service._client is not None
        assert not list(tmp_path.iterdir())
        assert len(list(loader)) == 6
        assert list(tmp_path.iterdir())  # the pass started its own
