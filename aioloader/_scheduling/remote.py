"""Decoding on an executor or a cluster (`executor=`): one decoder for every backend, with the
built-in pool's guarantees. A chunk running past `decode_timeout` is cancelled and fails (or is
skipped) as in the pool; the stall watchdog is told which task runs longest, and where; a chunk
whose worker died is sent again, up to `max_worker_restarts` per pass, and one that killed two
workers is not sent a third time.

A backend only ships the decode spec to its workers once, runs a chunk somewhere, says where,
and recognises a lost worker; `BACKENDS` finds the backend for what `executor=` was given.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import itertools
import pickle
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from .._blocking import off_loop
from .._ipc import transport
from .._ipc.channel import dumps
from .._ipc.messages import Chunk, ChunkResult
from .._stats import now
from .._tasks import TaskSet
from .._worker.decode import DecodeSpec, run_chunk
from .decoders import Recovery, short_list


def pack_spec(spec: DecodeSpec) -> bytes:
    """The spec as it travels to workers: with the trainer's import path, so a worker finds
    the modules it names (a decode function in the training script's folder)."""
    return pickle.dumps((list(sys.path), dumps(spec)))


@functools.lru_cache(maxsize=4)
def unpack_spec(data: bytes) -> DecodeSpec:
    """The spec on a worker: the trainer's import path entries it lacks are added (after its
    own) first. Kept per bytes: unpickled once per worker and spec."""
    paths, pickled = pickle.loads(data)
    sys.path.extend(path for path in paths if path not in sys.path)
    spec: DecodeSpec = pickle.loads(pickled)
    return spec


def run_pickled_chunk(spec: bytes, chunk: Chunk) -> ChunkResult:
    """A chunk decoded on a worker, the spec sent with it (`pack_spec`)."""
    return run_chunk(unpack_spec(spec), chunk)


@dataclass(eq=False)
class RemoteTask:
    """A chunk sent to a backend."""

    id: int
    chunk: Chunk
    started: float
    where: str = ""
    """The worker running it, once the backend knows."""
    handle: Any = None
    """The backend's own record of it (a future, an actor)."""


class Backend(Protocol):
    """Where chunks are decoded when `executor=` is given; kept by the Loader from pass to pass
    (the spec is shipped once), closed with it."""

    on_deadline: str
    """What happens to a task past its deadline, for the error: "its actor was replaced"."""

    async def start(self) -> None:
        """Ship the decode spec to the workers, start what the backend starts (once)."""
        ...

    def slots(self) -> int:
        """Chunks that run at once (worker threads, actors): no more are sent, so that none
        waits in a worker's queue, where its deadline would run out unstarted. Blocking
        (asked once a pass, off the loop)."""
        ...

    async def run(self, task: RemoteTask) -> ChunkResult:
        """Decode a chunk on a worker. Cancelled (a deadline, a pass dropped): let go of its
        result, and see that its worker does not stay busy with it."""
        ...

    async def stop(self, task: RemoteTask, lost: bool) -> None:
        """The task ran past its deadline: free its worker (kill or restart it, or wait for
        the task to end where nothing can stop it); or its worker died (`lost`): wait for its
        replacement where the backend makes one. Return once the worker is free."""
        ...

    def lost(self, error: BaseException) -> str | None:
        """How the worker running a task died, when `error` says it did; else None."""
        ...

    def locate(self, tasks: list[RemoteTask]) -> None:
        """Fill in where tasks run (blocking: a round trip to a scheduler, run off the loop)."""
        ...

    def close(self) -> None:
        """Let go of the cluster: what the backend started is stopped, a cluster it was given
        is left as it was found."""
        ...


def _is_dask_client(executor: object) -> bool:
    kind = type(executor)
    return kind.__module__.partition(".")[0] == "distributed" and kind.__name__ == "Client"


BACKENDS: list[tuple[Callable[[object], bool], str]] = [
    (lambda executor: executor == "ray", ".on_ray:RayBackend"),
    (_is_dask_client, ".on_dask:DaskBackend"),
    (lambda executor: isinstance(executor, Executor), ".on_executor:ExecutorBackend"),
]
"""What `executor=` may be, and the backend for it (`module:Class`, imported on use)."""
LOCATE_SECONDS = 1.0
"""A task running this long is located (where it runs), for the watchdog and its error."""


def backend_for(executor: object, spec: DecodeSpec, workers: int) -> Backend:
    """The backend for `executor`, with `workers` processes where it starts them (Ray); a
    ValueError naming what `executor=` takes, for anything else."""
    where = next((where for accepts, where in BACKENDS if accepts(executor)), None)
    if where is None:
        raise ValueError(
            f'executor= takes a concurrent.futures.Executor, a Dask distributed.Client or "ray"; '
            f"got {executor!r}"
        )
    module, _, name = where.partition(":")
    kind = getattr(importlib.import_module(module, __package__), name)
    backend: Backend = kind(executor, spec, workers)
    return backend


class BackendHolder:
    """A Loader's backend, made with the Loader (a missing extra shows at once) and kept until
    it closes: the spec is shipped once, on the first pass. Apart from the Loader so a
    finalizer can close it."""

    def __init__(self, executor: object, spec: DecodeSpec, workers: int) -> None:
        self.backend = backend_for(executor, spec, workers)
        self._closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            closed, self._closed = self._closed, True
        if not closed:
            self.backend.close()


class _PastDeadline(Exception):
    """A chunk ran past decode_timeout (not a TimeoutError: a backend's own may be one)."""


class RemoteDecoder:
    """A pass's use of a backend: the pool's guarantees, whatever runs the chunks. At most
    `slots` chunks are out at once; the slot of a chunk whose worker must be freed (past its
    deadline, or lost) is taken again only once the backend freed it. Such chunks stay in view
    of the stall watchdog meanwhile: a worker an executor cannot stop is named, not waited on
    for ever."""

    lends_late = False

    def __init__(
        self,
        backend: Backend,
        recovery: Recovery,
    ) -> None:
        self._backend = backend
        self.recovery = recovery
        self._ids = itertools.count()
        self._running: dict[int, RemoteTask] = {}
        """Chunks out, and those whose worker is being freed."""
        self._slots: asyncio.Semaphore | None = None
        self._freeing = TaskSet()
        self._failure: BaseException | None = None

    async def decode(self, chunk: Chunk) -> ChunkResult:
        await self._backend.start()
        if self._slots is None:  # per pass: a cluster may have grown or shrunk since
            slots = await off_loop(self._backend.slots)
            if self._slots is None:
                self._slots = asyncio.Semaphore(slots)
        deaths = 0
        while True:
            if self._failure is not None:
                raise self._failure
            await self._slots.acquire()
            task = RemoteTask(next(self._ids), chunk, now())
            self._running[task.id] = task
            freed = True
            try:
                result = await self._run(task)
                result.needed = transport.shared_bytes(result.items)  # counted while held
                return result
            except _PastDeadline:
                freed = False
                self._freeing.start(self._free(task, lost=False))
                where = task.where.removesuffix(", being freed") or "the executor"
                return _given(self.recovery.past_deadline(chunk, f"on {where}",
                                                          self._backend.on_deadline))
            except Exception as e:
                cause = self._backend.lost(e)
                if cause is None:
                    raise
                freed = False
                self._freeing.start(self._free(task, lost=True))
                deaths += 1
                where = f" on {task.where}" if task.where else ""
                self._failure = self.recovery.worker_lost(
                    f"a worker{where}", cause, chunk.indices,
                    "its chunk was sent again" if deaths < 2 else "its chunk is not sent again")
                if self._failure is not None:
                    raise self._failure from e
                if deaths >= 2:
                    return _given(self.recovery.killed_twice(chunk, "worker", cause))
            finally:
                if freed:
                    self._running.pop(task.id, None)
                    self._slots.release()

    async def _run(self, task: RemoteTask) -> ChunkResult:
        """The task's result; _PastDeadline once it ran past the deadline (cancelled here).
        A task still running after LOCATE_SECONDS asks the backend where it runs, off the
        loop (a round trip to a scheduler), for the watchdog and the deadline's error."""
        running = asyncio.ensure_future(self._backend.run(task))
        try:
            timeout = self.recovery.decode_timeout
            wait = timeout if timeout is not None else LOCATE_SECONDS
            done, _ = await asyncio.wait({running}, timeout=min(wait, LOCATE_SECONDS))
            if not done:
                await off_loop(self._backend.locate, [task])
                left = None if timeout is None else max(0.0, timeout - (now() - task.started))
                done, _ = await asyncio.wait({running}, timeout=left)
        except asyncio.CancelledError:
            running.cancel()
            raise
        if running in done:
            return running.result()
        running.cancel()
        raise _PastDeadline

    async def _free(self, task: RemoteTask, lost: bool) -> None:
        """Free the task's worker (see `Backend.stop`), then its slot."""
        assert self._slots is not None
        task.where = f"{task.where or 'the executor'}, being freed"
        try:
            await self._backend.stop(task, lost)
        finally:
            self._running.pop(task.id, None)
            self._slots.release()

    def in_flight(self) -> list[tuple[float, str]]:
        tasks = list(self._running.values())
        moment = now()
        return [(moment - task.started,
                 f"samples {short_list(task.chunk.indices)} on {task.where or 'the executor'}")
                for task in tasks]

    def abandon(self) -> None:
        """The chunks are cancelled with the pass's tasks that await them (a backend frees
        a worker left running them); the waits on workers being freed are let go of."""
        self._freeing.cancel_all()

    async def aclose(self) -> None:
        """The backend is the Loader's, kept for the next pass: only the waits on workers
        being freed are let go of (the freeing itself goes on)."""
        tasks = self._freeing.cancel_all()
        await asyncio.gather(*tasks, return_exceptions=True)


def _given(outcome: ChunkResult | Exception) -> ChunkResult:
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
