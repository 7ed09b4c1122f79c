"""The tasks one owner started (a pass, a source, a hold on the pool), so that it can cancel
and await them all when it lets go: each task leaves the set when it ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, coroutine: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `coroutine` as a task of the running loop, kept here until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self.add(task)
        return task

    def add(self, task: asyncio.Task[Any]) -> None:
        """Keep a task started elsewhere (or kept by another set too) until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def cancel_all(self) -> list[asyncio.Task[Any]]:
        """Cancel every task; the tasks, to await if the loop still runs."""
        tasks = list(self._tasks)
        for task in tasks:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                task.cancel()
        return tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))
