"""Decoding on a `concurrent.futures.Executor` the caller owns (`executor=`)."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Executor

from .._ipc.messages import ChunkResult
from .._worker.decode import DecodeSpec
from .remote import RemoteTask, pack_spec, run_pickled_chunk


class ExecutorBackend:
    """The spec travels with every task, pickled once here: an arbitrary executor has no
    initializer to send it once. A task cancelled before it starts never runs; one already
    running cannot be stopped, and its result is dropped. A broken process pool cannot be
    mended from outside: its error ends the pass."""

    on_deadline = "nothing stops a running task on an executor: its worker is used again once "\
        "the task ends"

    def __init__(self, executor: Executor, spec: DecodeSpec, workers: int) -> None:
        self._executor = executor
        self._spec = pack_spec(spec)
        self._name = f"{type(executor).__name__} {id(executor):#x}"
        self._slots: int = getattr(executor, "_max_workers", workers)
        """The standard library's executors keep their size there; others: num_workers."""

    async def start(self) -> None:
        return

    def slots(self) -> int:
        return self._slots

    async def run(self, task: RemoteTask) -> ChunkResult:
        task.where = self._name
        task.handle = self._executor.submit(run_pickled_chunk, self._spec, task.chunk)
        return await asyncio.wrap_future(task.handle)  # cancelled: the executor's future too

    async def stop(self, task: RemoteTask, lost: bool) -> None:
        """Nothing stops a running task here: its worker is free when it ends."""
        with contextlib.suppress(BaseException):
            await asyncio.wrap_future(task.handle)

    def lost(self, error: BaseException) -> str | None:
        return None  # a BrokenProcessPool stays broken: retrying there cannot help

    def locate(self, tasks: list[RemoteTask]) -> None:
        return

    def close(self) -> None:
        return  # the executor is the caller's

