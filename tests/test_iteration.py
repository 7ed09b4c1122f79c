"""How a Loader iterates, tried without any process: where it stands (`Position`), one pass at
a time (`Runner`), and the two handles behind one interface, a pass run here (decoding inline)
and a pass run in a service (a fake client in its place)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import aioloader
from aioloader import _reaper as reaper
from aioloader._config import LoaderConfig
from aioloader._iteration.handles import (
    AsyncIteration,
    Handle,
    Iteration,
    LocalHandle,
    Opening,
    ServiceHandle,
)
from aioloader._iteration.runner import Position, Runner
from aioloader._pass.factory import PassFactory
from aioloader._pass.pipeline import END
from aioloader._service.holder import ServiceHolder


class Numbers(aioloader.Dataset):
    def __len__(self) -> int:
        return 10

    async def fetch(self, index: int) -> int:
        return index


def test_a_position_starts_where_it_resumes_and_any_pass_ends_at_the_next_epoch() -> None:
    resumed = Position(2, 40, 40, ((0, 5),))
    assert resumed.started() == Position(2, 40, None, ((0, 5),))
    assert resumed.start == resumed.started().start == 40
    assert Position(2, 40).started() == Position(2, 0)  # no resume point: the epoch's start
    assert resumed.started().ended() == Position(3)  # finished or broken off alike
    assert resumed.at_epoch(2) is resumed  # set_epoch of the saved epoch keeps the resume
    assert resumed.at_epoch(3) == Position(3)


def _runner(batch_size: int = 4) -> Runner:
    config = LoaderConfig(dataset=Numbers(), batch_size=batch_size, num_workers=0)
    return Runner(PassFactory(config), ServiceHolder())


def _numbers(batch: Any) -> list[int]:
    return [int(i) for i in batch]


def test_a_local_pass_runs_one_at_a_time_and_books_where_it_left_the_loader() -> None:
    runner = _runner()
    owner = object()
    batches = Iteration(owner, runner.open)
    assert _numbers(next(batches)) == [0, 1, 2, 3]
    assert runner.position == 4
    with pytest.raises(aioloader.LoaderError, match="already running"):
        runner.open()
    batches.close()  # a `break`
    assert runner.at == Position(1)  # broken off: the next epoch, as a finished pass
    assert [_numbers(b) for b in Iteration(owner, runner.open)] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                  [8, 9]]
    assert runner.at == Position(2)


def test_an_async_pass_dropped_mid_pass_is_released_before_the_next_opens() -> None:
    runner = _runner()

    async def run() -> list[list[int]]:
        first = AsyncIteration(object(), runner.open_async)
        await first.__anext__()
        del first  # a `break` in `async for`: the release is queued on this loop
        return [_numbers(b) async for b in AsyncIteration(object(), runner.open_async)]

    assert asyncio.run(run()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert runner.at == Position(2)


def test_closing_the_runner_makes_a_running_pass_raise_and_refuses_new_ones() -> None:
    runner = _runner(batch_size=2)
    batches = Iteration(object(), runner.open)
    next(batches)
    threading.Thread(target=runner.close).start()  # Loader.close, from another thread
    with pytest.raises(aioloader.LoaderError, match="closed"):
        list(batches)
    with pytest.raises(aioloader.LoaderError, match="closed"):
        runner.open()


class FakeClient:
    """A loader service's client, as a ServiceHandle uses it: batches 0..count-1, each with
    the position after it (and no IterableDataset's copies)."""

    def __init__(self, count: int) -> None:
        self.sent = iter(range(count))
        self.pass_open = self.closed = False
        self.stopped: list[bool] = []

    def open(self, epoch: int, start: int, remaining: Any, copies: Any) -> None:
        self.pass_open = True
        self.sent = iter(range(start, 5))

    def next(self) -> tuple[Any, int, None] | None:
        item = next(self.sent, None)
        if item is None:
            self.pass_open = False
            return None
        return item, item + 1, None

    async def next_async(self) -> tuple[Any, int, None] | None:
        return self.next()

    def stop(self, wait: bool = True) -> None:
        self.stopped.append(wait)
        self.pass_open = False


def _opening(client: FakeClient, start: int, ended: list[Handle]) -> Opening:
    factory = PassFactory(LoaderConfig(dataset=Numbers(), num_workers=0))
    return Opening(0, start, None, None, factory, lambda: client, ended.append)  # type: ignore[arg-type, return-value]


def test_a_service_pass_books_each_batch_and_tells_once_that_it_ended() -> None:
    client, ended = FakeClient(5), list[Handle]()
    handle = ServiceHandle.open(_opening(client, 2, ended))
    assert [handle.next(), handle.next()] == [2, 3]
    assert handle.position == 4
    assert asyncio.run(handle.next_async()) == 4
    assert handle.next() is END
    handle.close()
    assert ended == [handle] and client.stopped == []  # finished: nothing to stop


def test_a_service_pass_broken_off_or_dropped_stops_the_service_once() -> None:
    client, ended = FakeClient(5), list[Handle]()
    handle = ServiceHandle.open(_opening(client, 0, ended))
    handle.next()
    handle.close()
    handle.close()
    assert client.stopped == [True] and ended == [handle]
    dropped = ServiceHandle.open(_opening(client, 0, ended))
    reaper.start()  # as a Loader does when it is made
    dropped.drop()  # a finalizer: the stop goes to the reaper's thread, without waiting
    for _ in range(200):
        if len(ended) == 2:
            break
        threading.Event().wait(0.01)
    assert client.stopped == [True, False] and ended == [handle, dropped]


def test_the_runner_chooses_the_handle_once_from_the_configuration() -> None:
    here = LoaderConfig(dataset=Numbers(), num_workers=0)
    served = LoaderConfig(dataset=Numbers(), num_workers=1, service="process")
    assert isinstance(Runner(PassFactory(here), ServiceHolder()).open(), LocalHandle)
    assert Runner(PassFactory(served), ServiceHolder())._kind is ServiceHandle
