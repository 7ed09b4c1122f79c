"""Decoding on Ray actors (`executor="ray"`; the extra `aioloader[ray]`): the cluster
`ray.init()` finds (RAY_ADDRESS), or a local one started here and stopped once the last Loader
using it closes."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from typing import Any

from .._errors import LoaderError
from .blocking import off_loop
from .decode import DecodeSpec, run_chunk
from .messages import Chunk, ChunkResult
from .remote import RemoteTask, pack_spec, unpack_spec

START_SECONDS = 120.0
_ray_lock = threading.Lock()
_ray_users = 0
"""Loaders using Ray in this process."""
_ray_started = False
"""Ray was started here (not found running): shut down when its last user closes."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(f'ray is needed for executor="ray": pip install \'aioloader[ray]\' '
                          f"({e})") from None
    return ray


def _use_ray(ray: Any) -> None:
    global _ray_users, _ray_started
    with _ray_lock:
        if not ray.is_initialized():
            ray.init(include_dashboard=False, configure_logging=False)
            _ray_started = True
        _ray_users += 1


def _let_go_of_ray(ray: Any) -> None:
    global _ray_users, _ray_started
    with _ray_lock:
        _ray_users -= 1
        if _ray_users == 0 and _ray_started:
            _ray_started = False
            ray.shutdown()


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
    actor whose chunk was cancelled (a deadline, a pass dropped) or that died is replaced, and
    none is given a chunk while it is. Closing kills the actors; Ray started here stops when
    its last Loader closes, Ray found running is left so."""

    on_deadline = "its Ray actor was killed and replaced"

    def __init__(self, executor: str, spec: DecodeSpec, workers: int) -> None:
        self._ray = import_ray()
        self._spec = pack_spec(spec)
        self._count = workers
        self._actors: list[Any] = []
        self._where: list[str] = []
        self._busy: list[int] = []
        self._replacing: dict[int, Future[None]] = {}
        self._using = False
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
            if not self._using:
                _use_ray(ray)
                self._using = True
            cpus = ray.cluster_resources().get("CPU", 0)
            if cpus < self._count:
                raise LoaderError(f"the Ray cluster has {cpus:g} CPUs: too few for "
                                  f"num_workers={self._count} actors of one CPU each")
            self._spec_ref = ray.put(self._spec)
            actors = [self._new_actor() for _ in range(self._count)]
            try:
                self._where = ray.get([a.where.remote() for a in actors], timeout=START_SECONDS)
            except BaseException as e:
                for actor in actors:
                    ray.kill(actor, no_restart=True)
                if isinstance(e, ray.exceptions.GetTimeoutError):
                    free = ray.available_resources().get("CPU", 0)
                    raise LoaderError(
                        f"{self._count} Ray actors of one CPU each did not start within "
                        f"{START_SECONDS:g} s ({free:g} of {cpus:g} CPUs free)") from e
                raise
            self._busy = [0] * self._count
            self._actors = actors

    def slots(self) -> int:
        return self._count

    async def run(self, task: RemoteTask) -> ChunkResult:
        number = await self._pick()
        task.handle, task.where = number, f"Ray actor {number} ({self._where[number]})"
        self._busy[number] += 1
        try:
            result: ChunkResult = await self._actors[number].decode.remote(task.chunk)
            return result
        except (asyncio.CancelledError, self._ray.exceptions.RayActorError):
            self._retire(number)  # left busy with the chunk, or dead
            raise
        finally:
            self._busy[number] -= 1

    async def _pick(self) -> int:
        """The least busy actor not being replaced (waiting for one if all are)."""
        while True:
            ready = [n for n in range(self._count) if n not in self._replacing]
            if ready:
                return min(ready, key=self._busy.__getitem__)
            replacing = list(self._replacing.values())  # a thread may end one meanwhile
            if replacing:
                await asyncio.wait([asyncio.wrap_future(f) for f in replacing],
                                   return_when=asyncio.FIRST_COMPLETED)

    def _retire(self, number: int) -> None:
        """Replace the actor on a thread of its own; it gets no chunk until then."""
        if number in self._replacing:
            return
        done: Future[None] = Future()
        self._replacing[number] = done

        def replace() -> None:
            done.set_running_or_notify_cancel()  # no longer cancellable by a waiter
            try:
                self._replace(number)
                done.set_result(None)
            except BaseException as e:
                done.set_exception(e)

        threading.Thread(target=replace, name="aioloader-ray-replace", daemon=True).start()

    def lost(self, error: BaseException) -> str | None:
        if isinstance(error, self._ray.exceptions.RayActorError):
            return "the Ray actor died: " + (str(error).strip().splitlines() or ["?"])[0]
        return None

    def locate(self, tasks: list[RemoteTask]) -> None:
        return  # known from the start

    async def stop(self, task: RemoteTask, lost: bool) -> None:
        """Wait for the replacement begun when the chunk was cancelled or its actor died."""
        replacing = self._replacing.get(task.handle)
        if replacing is not None:  # a waiter let go of must not cancel the replacement
            await asyncio.shield(asyncio.wrap_future(replacing))

    def _replace(self, number: int) -> None:
        """Kill the actor (if it still lives) and start another in its place."""
        ray = self._ray
        try:
            with self._lock:
                if not self._actors:
                    return  # closed meanwhile
                ray.kill(self._actors[number], no_restart=True)
                fresh = self._new_actor()
                self._where[number] = ray.get(fresh.where.remote(), timeout=START_SECONDS)
                self._actors[number] = fresh
        finally:
            self._replacing.pop(number, None)

    def _new_actor(self) -> Any:
        return self._ray.remote(num_cpus=1, max_restarts=0)(DecodeActor).remote(self._spec_ref)

    def close(self) -> None:
        ray = self._ray
        with self._lock:
            actors, self._actors = self._actors, []
            for actor in actors:
                ray.kill(actor, no_restart=True)
            using, self._using = self._using, False
        if using:
            _let_go_of_ray(ray)
