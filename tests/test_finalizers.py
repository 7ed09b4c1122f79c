"""Finalizers hand their work over, and no wait of the consumer is unbounded: a Loader
collected at the wrong moment, or a loop that a dataset wedges, never hangs the trainer."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import psutil
import pytest
from segments import blocks
from test_service import wait_until_gone

import aioloader
from aioloader import _reaper as reaper
from aioloader._ipc.channel import Channel
from aioloader._iteration import handles
from aioloader._processes.zygote import Zygote

from conftest import ended, snapshot
from decoders import index_and_pid, stuck_on_five


def test_a_loader_collected_inside_a_zygote_request_does_not_deadlock_on_its_lock(
    local_paths: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The garbage collector runs an earlier Loader's finalizer inside a zygote request (the
    thread holds the zygote's lock); its shutdown asks the zygote too. It used to wait for the
    lock its own thread held, and every later request behind it."""
    first = aioloader.Loader(aioloader.Files(local_paths[:8]), decode=index_and_pid,
                             batch_size=4, num_workers=1, service="process")
    pids = {int(pid) for batch in first for pid in batch[1]}
    collected = weakref.ref(first)
    gc.disable()  # the cycle lives until the collection inside the request
    try:
        first.itself = first  # type: ignore[attr-defined]
        del first
        send = Channel.send
        collections: list[int] = []

        def send_after_a_collection(self: Channel, message: Any, fds: Sequence[int] = ()) -> None:
            if not collections:
                collections.append(gc.collect())
            send(self, message, fds)

        monkeypatch.setattr(Channel, "send", send_after_a_collection)
        asking = threading.Thread(target=Zygote.get().preload, args=([],), daemon=True)
        asking.start()
        asking.join(30)
        assert not asking.is_alive(), "the zygote request waited for its own thread"
    finally:
        gc.enable()
    assert collections and collected() is None, "the Loader was collected inside the request"
    deadline = time.monotonic() + 20
    while not all(ended(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(ended(pid) for pid in pids), "the reaper stopped the collected Loader's processes"


def test_a_finalizer_hands_its_work_to_the_reaper_and_close_runs_it_in_place() -> None:
    ran: list[str] = []

    class Owner:
        pass

    owner = Owner()
    shutdown = reaper.Shutdown(owner, lambda: ran.append(threading.current_thread().name))
    shutdown()
    shutdown()
    assert ran == [threading.current_thread().name], "close: once, in the closing thread"
    other = Owner()
    reaper.Shutdown(other, lambda: ran.append(threading.current_thread().name))
    del other
    deadline = time.monotonic() + 10
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran[1:] == ["aioloader-reaper"]


class Wedged(aioloader.Dataset):
    """A dataset whose fetch blocks the event loop (time.sleep where asyncio.sleep belongs)."""

    def __len__(self) -> int:
        return 8

    async def fetch(self, index: int) -> int:
        time.sleep(1)  # noqa: ASYNC251 - the fault under test: a batch holds the loop 4 s
        return index


def test_a_wedged_event_loop_gives_a_stall_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handles, "EXTRA_SECONDS", 0.5)
    loader = aioloader.Loader(Wedged(), batch_size=4, num_workers=0, stall_timeout=1,
                              service=None)
    started = time.monotonic()
    with pytest.raises(aioloader.StallError, match=r"gave no batch within 1\.5 s"):
        next(iter(loader))
    assert time.monotonic() - started < 15
    loader.close()


@pytest.mark.parametrize("service", [None, "process"])
def test_an_interrupted_pass_whose_exception_is_kept_does_not_keep_its_loader(
    local_paths: list[str], service: str | None
) -> None:
    """A notebook keeps an interrupted cell's exception (IPython's last result, `sys.last_value`),
    and with it every frame it went through: the pass's iterator among them must not keep the
    Loader, so that `del loader` ends its service and frees its blocks."""
    before = snapshot().processes  # the session's servers are not the Loader's
    loader = aioloader.Loader(aioloader.Files(local_paths[:16]), decode=stuck_on_five,
                              batch_size=4, num_workers=1, service=service)
    collected = weakref.ref(loader)
    main = threading.main_thread().ident
    assert main is not None
    kept: BaseException | None = None
    try:
        for n, _ in enumerate(loader):  # the second batch never comes: sample 5 is stuck
            if n == 0:
                threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()
    except KeyboardInterrupt as e:  # Ctrl-C, as a notebook's interrupt sends it
        kept = e
    assert kept is not None and kept.__traceback__ is not None
    family = [psutil.Process(pid) for pid in snapshot().processes - before]
    made = set(blocks([os.getpid(), *(process.pid for process in family)]))
    del loader, _  # the batch taken, too: a view keeps its block's memory
    gc.collect()
    assert collected() is None  # its finalizer ran: service, processes and blocks go
    wait_until_gone(family, made)
