"""Decoding on Ray actors (`executor="ray"`; the extra `aioloader[ray]`): the cluster
`ray.init()` finds (RAY_ADDRESS), or a local one started for the Loader and stopped with it."""

from __future__ import annotations

import os
import threading
from typing import Any

from .._errors import LoaderError
from .blocking import off_loop
from .decode import DecodeSpec, run_chunk
from .messages import Chunk, ChunkResult
from .remote import RemoteTask, pack_spec, unpack_spec

START_SECONDS = 120.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(f'ray is needed for executor="ray": pip install \'aioloader[ray]\' '
                          f"({e})") from None
    return ray


class DecodeActor:
    """One worker: the spec unpickled once, when the actor starts; a chunk at a time."""

    def __init__(self, spec: bytes) -> None:
        self._spec = unpack_spec(spec)

    def where(self) -> str:
        util: Any = import_ray().util
        return f"pid {os.getpid()} on {util.get_node_ip_address()}"

    def decode(self, chunk: Chunk) -> ChunkResult:
        return run_chunk(self._spec, chunk)


class RayBackend:
    """`num_workers` actors of one CPU each, each running one chunk at a time. The spec goes
    into Ray's object store once and reaches each actor once; each task carries its chunk. An
    actor that dies, or runs past the deadline (killed), is replaced. Closing kills the
    actors, and stops or leaves the cluster as it was found: Ray started here is shut down."""

    def __init__(self, executor: str, spec: DecodeSpec, workers: int) -> None:
        self._ray = import_ray()
        self._spec = pack_spec(spec)
        self._count = workers
        self._actors: list[Any] = []
        self._where: list[str] = []
        self._busy: list[int] = []
        self._started_ray = False
        self._spec_ref: Any = None
        self._lock = threading.Lock()

    async def start(self) -> None:
        if not self._actors:
            await off_loop(self._start)

    def _start(self) -> None:
        ray = self._ray
        with self._lock:
            if self._actors:
                return
            if not ray.is_initialized():
                ray.init(include_dashboard=False, configure_logging=False)
                self._started_ray = True
            cpus = ray.cluster_resources().get("CPU", 0)
            if cpus < self._count:
                raise LoaderError(f"the Ray cluster has {cpus:g} CPUs: too few for num_workers="
                                  f"{self._count} actors of one CPU each")
            self._spec_ref = ray.put(self._spec)
            actors = [self._new_actor() for _ in range(self._count)]
            self._where = ray.get([a.where.remote() for a in actors], timeout=START_SECONDS)
            self._busy = [0] * self._count
            self._actors = actors

    def slots(self) -> int:
        return self._count

    async def run(self, task: RemoteTask) -> ChunkResult:
        number = min(range(self._count), key=self._busy.__getitem__)
        task.handle, task.where = number, f"Ray actor {number} ({self._where[number]})"
        self._busy[number] += 1
        try:
            result: ChunkResult = await self._actors[number].decode.remote(task.chunk)
            return result
        except self._ray.exceptions.RayActorError:
            await off_loop(self._replace, number)
            raise
        finally:
            self._busy[number] -= 1

    def lost(self, error: BaseException) -> str | None:
        if isinstance(error, self._ray.exceptions.RayActorError):
            return "the Ray actor died: " + (str(error).strip().splitlines() or ["?"])[0]
        return None

    def locate(self, tasks: list[RemoteTask]) -> None:
        return  # known from the start

    async def stop(self, task: RemoteTask) -> None:
        await off_loop(self._replace, task.handle)

    def _replace(self, number: int) -> None:
        """Kill the actor (if it still lives) and start another in its place."""
        ray = self._ray
        with self._lock:
            if not self._actors:
                return  # closed meanwhile
            ray.kill(self._actors[number], no_restart=True)
            fresh = self._new_actor()
            self._where[number] = ray.get(fresh.where.remote(), timeout=START_SECONDS)
            self._actors[number] = fresh

    def _new_actor(self) -> Any:
        return self._ray.remote(num_cpus=1, max_restarts=0)(DecodeActor).remote(self._spec_ref)

    def close(self) -> None:
        ray = self._ray
        with self._lock:
            actors, self._actors = self._actors, []
            for actor in actors:
                ray.kill(actor, no_restart=True)
            if self._started_ray:
                self._started_ray = False
                ray.shutdown()
