"""Decoding on a Dask cluster through its `distributed.Client` (`executor=client`; the extra
`aioloader[dask]`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from distributed import KilledWorker, WorkerPlugin, get_worker

from .._blocking import off_loop
from .._errors import LoaderError
from .._ipc.messages import Chunk, ChunkResult
from .._worker.decode import DecodeSpec, run_chunk
from .remote import RemoteTask, pack_spec, unpack_spec

RESTART_SECONDS = 60
RELEASE_SECONDS = 5.0
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
    spec = _specs.get(name)
    if spec is None:  # a worker that joined while the plugin was being registered
        plugin = get_worker().plugins.get(name)
        if plugin is None:
            raise LoaderError(f"this Dask worker has not got the decode spec {name} (its "
                              "plugin was removed: the Loader was closed)")
        plugin.setup(get_worker())
        spec = _specs[name]
    return run_chunk(spec, chunk)


@dataclass
class _Submitted:
    key: str
    worker: str | None = None
    """The worker's address, once located."""


class DaskBackend:
    """The spec reaches every worker once, by a worker plugin, and each task carries only its
    chunk. A worker that dies has its tasks run again elsewhere by Dask's scheduler itself, up
    to its `allowed-failures`; past that Dask raises KilledWorker, counted here as a worker
    lost. Dask cannot interrupt a running task: one past its deadline has its worker restarted
    (by its nanny), as the pool kills its process. The client and its cluster are the
    caller's: closing removes the plugin and leaves them running."""

    on_deadline = "its Dask worker was restarted"

    def __init__(self, client: Any, spec: DecodeSpec, workers: int) -> None:
        self._client = client
        self._spec = pack_spec(spec)
        self._name = f"aioloader-decode-{uuid.uuid4().hex[:8]}"
        self._registered = False
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._restarted: set[str] = set()
        """Workers restarted here (a deadline's): a task they took with them is sent again,
        not counted as a worker lost."""

    async def start(self) -> None:
        if not self._registered:
            await off_loop(self._ship)

    def _ship(self) -> None:
        with self._lock:
            if not self._registered:
                self._registered = True  # the scheduler keeps it even if a worker's setup fails
                self._client.register_plugin(ShipSpec(self._name, self._spec), name=self._name)

    def slots(self) -> int:
        """The cluster's worker threads now."""
        threads: dict[str, int] = self._client.nthreads()
        return max(sum(threads.values()), 1)

    async def run(self, task: RemoteTask) -> ChunkResult:
        """The chunk's result; sent again when a restart of ours (another chunk's deadline)
        killed it: the scheduler may have given it to that worker once the stuck task was
        cancelled, and no worker was lost to it. Once only: a worker that comes back at the
        same address and dies again is lost."""
        resent = False
        while True:
            submitted = task.handle = _Submitted(f"{self._name}-{next(self._ids)}")
            future = self._client.submit(run_named_chunk, self._name, task.chunk,
                                         key=submitted.key, pure=False)
            try:
                result: ChunkResult = await off_loop(self._gather, future)
                return result
            except KilledWorker as e:
                if resent or getattr(e.last_worker, "address", None) not in self._restarted:
                    raise
                resent = True
            except asyncio.CancelledError:
                threading.Thread(target=future.cancel, name="aioloader-dask-cancel",
                                 daemon=True).start()
                raise

    def _gather(self, future: Any) -> ChunkResult:
        """The result straight from its worker, unless the client was told to go through the
        scheduler (`direct_to_workers=False`, for workers it cannot reach): Dask's default
        relays every result through the scheduler, a second copy of each batch."""
        direct = self._client.direct_to_workers
        result: ChunkResult = self._client.gather(future, direct=direct is not False)
        return result

    def lost(self, error: BaseException) -> str | None:
        return f"Dask gave up on the task: {error}" if isinstance(error, KilledWorker) else None

    def locate(self, tasks: list[RemoteTask]) -> None:
        """Ask the scheduler which worker processes each task."""
        where = {key: worker for worker, keys in self._client.processing().items()
                 for key in keys}
        for task in tasks:
            submitted: _Submitted = task.handle
            submitted.worker = where.get(submitted.key)
            task.where = (f"Dask worker {submitted.worker}" if submitted.worker
                          else "the Dask cluster")

    async def stop(self, task: RemoteTask, lost: bool) -> None:
        """Restart the worker running the task (nothing else interrupts it); a worker lost
        is restarted by its nanny already."""
        worker = task.handle.worker if task.handle is not None else None
        if worker is not None and not lost:
            self._restarted.add(worker)
            await off_loop(lambda: self._client.restart_workers(
                [worker], timeout=RESTART_SECONDS, raise_for_error=False))

    def close(self) -> None:
        with self._lock:
            registered, self._registered = self._registered, False
        if registered and self._client.status == "running":
            # the scheduler forgets it first; a worker restarting now (a deadline's) answers
            # KeyError (it has none) or closes the connection: no failure of ours
            with contextlib.suppress(KeyError, OSError):
                self._client.unregister_worker_plugin(self._name)
            self._wait_for_release()

    def _wait_for_release(self) -> None:
        """Results dropped here are released by the client in the background: wait (a few
        seconds at most) until no worker holds one, so the cluster is left as found."""
        deadline = time.monotonic() + RELEASE_SECONDS
        while time.monotonic() < deadline and any(
            str(key).startswith(self._name)
            for keys in self._client.has_what().values() for key in keys
        ):
            time.sleep(0.05)
