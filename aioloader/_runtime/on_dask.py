"""Decoding on a Dask cluster through its `distributed.Client` (`executor=client`; the extra
`aioloader[dask]`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import uuid
from typing import Any

from distributed import KilledWorker, WorkerPlugin

from .blocking import off_loop
from .decode import DecodeSpec, run_chunk
from .messages import Chunk, ChunkResult
from .remote import RemoteTask, pack_spec, unpack_spec

RESTART_SECONDS = 60
_specs: dict[str, DecodeSpec] = {}
"""In a worker: the decode specs its plugins brought, by name."""


class ShipSpec(WorkerPlugin):
    """The decode spec, unpickled once in every worker, also in one that joins or restarts
    later; removed with the plugin."""

    def __init__(self, name: str, spec: bytes) -> None:
        self.name = name
        self._spec = spec

    def setup(self, worker: Any) -> None:
        _specs[self.name] = unpack_spec(self._spec)

    def teardown(self, worker: Any) -> None:
        _specs.pop(self.name, None)


def run_named_chunk(name: str, chunk: Chunk) -> ChunkResult:
    return run_chunk(_specs[name], chunk)


class DaskBackend:
    """The spec reaches every worker once, by a worker plugin, and each task carries only its
    chunk. A worker that dies has its tasks run again elsewhere by Dask's scheduler itself, up
    to its `allowed-failures`; past that Dask raises KilledWorker, counted here as a worker
    lost. Dask cannot interrupt a running task: one past its deadline has its worker restarted
    (by its nanny), as the pool kills its process. The client and its cluster are the
    caller's: closing removes the plugin and leaves them running."""

    def __init__(self, client: Any, spec: DecodeSpec, workers: int) -> None:
        self._client = client
        self._spec = pack_spec(spec)
        self._name = f"aioloader-decode-{uuid.uuid4().hex[:8]}"
        self._shipped = False
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._keys: dict[int, str] = {}
        self._workers: dict[int, str] = {}
        """Where the tasks the stall watchdog or a deadline asked about run."""
        self._threads = 0

    async def start(self) -> None:
        if not self._shipped:
            await off_loop(self._ship)

    def _ship(self) -> None:
        with self._lock:
            if not self._shipped:
                self._threads = sum(self._client.nthreads().values())
                self._client.register_plugin(ShipSpec(self._name, self._spec), name=self._name)
                self._shipped = True

    def slots(self) -> int:
        return max(self._threads, 1)

    async def run(self, task: RemoteTask) -> ChunkResult:
        key = f"{self._name}-{next(self._ids)}"
        self._keys[task.id] = key
        future = self._client.submit(run_named_chunk, self._name, task.chunk, key=key,
                                     pure=False)
        try:
            result: ChunkResult = await off_loop(future.result)
            return result
        except asyncio.CancelledError:
            threading.Thread(target=future.cancel, name="aioloader-dask-cancel",
                             daemon=True).start()
            raise
        finally:
            self._keys.pop(task.id, None)

    def lost(self, error: BaseException) -> str | None:
        return f"Dask gave up on the task: {error}" if isinstance(error, KilledWorker) else None

    def locate(self, tasks: list[RemoteTask]) -> None:
        """Ask the scheduler which worker processes each task (only when the stall watchdog
        or a deadline asks: it is a round trip)."""
        where = {key: worker for worker, keys in self._client.processing().items()
                 for key in keys}
        for task in tasks:
            worker = where.get(self._keys.get(task.id, ""))
            task.where = f"Dask worker {worker}" if worker else "the Dask cluster"
            if worker:
                self._workers[task.id] = worker

    async def stop(self, task: RemoteTask) -> None:
        """Restart the worker running the task: nothing else interrupts it."""
        worker = self._workers.pop(task.id, None)
        if worker is not None:
            await off_loop(lambda: self._client.restart_workers(
                [worker], timeout=RESTART_SECONDS, raise_for_error=False))

    def close(self) -> None:
        with self._lock:
            shipped, self._shipped = self._shipped, False
        if shipped:  # the scheduler forgets it first; a worker restarting now (a deadline's)
            # answers KeyError (it has none) or closes the connection: no failure of ours
            with contextlib.suppress(KeyError, OSError):
                self._client.unregister_worker_plugin(self._name)
