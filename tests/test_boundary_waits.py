"""Every wait across a process boundary has a short bound: a stopped service is named within
seconds (its heartbeat went quiet), not after `stall_timeout` plus a minute, and `close()`
with an iterator still suspended returns at once in every mode."""

from __future__ import annotations

import os
import signal
import time

import pytest

import aioloader
from aioloader._service import client as service_client

from decoders import index_of


@pytest.mark.parametrize("service", ["process", "node"])
def test_a_stopped_service_is_named_within_seconds_not_after_stall_timeout(
    service: str, local_paths: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP (a debugger, a job control slip) left ranks waiting stall_timeout + 60 s: 660 s
    with the defaults. The silence allowed is shortened here (15 s by default)."""
    monkeypatch.setattr(service_client, "SILENCE_SECONDS", 4.0)
    loader = aioloader.Loader(aioloader.Files(local_paths[:64]), decode=index_of, batch_size=4,
                              num_workers=1, service=service)  # type: ignore[arg-type]
    batches = iter(loader)
    next(batches)
    client = loader._service._client
    assert client is not None
    os.kill(client.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(aioloader.LoaderError, match="not even its heartbeat"):
            for _ in batches:
                pass
        waited = time.monotonic() - started
        print(f"{service}: a stopped service named after {waited:.1f} s")
        assert waited < 4.0 + 15
    finally:
        os.kill(client.pid, signal.SIGCONT)
        loader.close()


@pytest.mark.parametrize("service", [None, "process", "node"])
def test_close_with_an_iterator_still_suspended_returns_at_once(
    service: str | None, local_paths: list[str]
) -> None:
    """With service=None it waited 5 s for the suspended `for` to come back and end its pass."""
    loader = aioloader.Loader(aioloader.Files(local_paths[:64]), decode=index_of, batch_size=4,
                              num_workers=1, service=service)  # type: ignore[arg-type]
    batches = iter(loader)
    next(batches)
    started = time.monotonic()
    loader.close()
    took = time.monotonic() - started
    print(f"service={service}: close() with a live iterator took {took:.2f} s")
    assert took < 2.5
    with pytest.raises(aioloader.LoaderError, match="closed"):
        for _ in batches:
            pass
