"""Decoding on Ray actors (`executor="ray"`; the extra `aioloader[ray]`).

A Loader uses the Ray this process already holds (`ray.init()` called by the user), the cluster
RAY_ADDRESS names, or else a local instance it starts; never one it finds running: Ray ends a
process whose cluster goes away, and another job's instance goes away when that job ends. Ray
started here is started from a thread that lasts as long as it (Linux ends the head with the
thread that started it), and stopped when the last Loader using it closes: `ray.shutdown()`,
then, by pid, the processes that outlive it (the raylet's agents and workers), then its session
folder. A Loader waiting on Ray checks every second that the instance is still there: a lost
one is a LoaderError naming it, raised well before Ray's reconnect timeout would end the
process."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from .._blocking import off_loop
from .._errors import LoaderError
from .._ipc.messages import Chunk, ChunkResult
from .._worker.decode import DecodeSpec, run_chunk
from .remote import RemoteTask, pack_spec, unpack_spec

START_SECONDS = 120.0
CHECK_SECONDS = 1.0
"""How often a Loader waiting on Ray checks that the instance is still there."""
PROBE_SECONDS = 2.0
"""A connection to the instance's GCS taking longer fails a check."""
LOST_SECONDS = 5.0
"""A GCS that does not answer (a refusal counts at once) for this long is lost."""
TERM_SECONDS = 1.0
"""The grace a process of a Ray started here gets after SIGTERM, as Ray's own shutdown gives."""
STOP_SECONDS = 5.0
"""The wait for those processes to end after SIGKILL."""
LOCAL_CONFIG = {"gcs_rpc_server_reconnect_timeout_s": 3600,
                "task_events_shutdown_flush_timeout_ms": 500}
"""For Ray started here. The reconnect timeout: Ray's core ends the process once the GCS has
been gone this long (60 s by default), a Loader idle between epochs with it; the checks find a
lost instance within a second, and close() stops it. The flush timeout: how long
`ray.shutdown()` tries to send a GCS that is gone the task events (5 s by default) that the
instance's end throws away anyway."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(f'ray is needed for executor="ray": pip install \'aioloader[ray]\' '
                          f"({e})") from None
    return ray


def _psutil() -> Any:
    """Ray's own dependency (it ships a copy of it)."""
    return importlib.import_module("psutil")


def _running(process: Any) -> bool:
    """Whether a psutil.Process still runs (a zombie has ended; its parent reaps it)."""
    psutil = _psutil()
    try:
        return bool(process.is_running()) and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end(processes: Iterable[Any]) -> None:
    """SIGTERM, then SIGKILL to those still running TERM_SECONDS later; bounded waits. A
    psutil.Process whose pid was taken by another process is not signalled."""
    psutil = _psutil()
    left = [p for p in processes if _running(p)]
    for number, wait in ((signal.SIGTERM, TERM_SECONDS), (signal.SIGKILL, STOP_SECONDS)):
        for process in left:
            with contextlib.suppress(psutil.Error):
                process.send_signal(number)
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = [p for p in left if _running(p)]


def _ended(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


class Instance:
    """The Ray instance this process's Loaders use: how to tell it is gone and, for one a
    Loader started or connected to, how to let go of it."""

    def __init__(self, ray: Any, started: bool, connected: bool,
                 owner: tuple[threading.Event, threading.Thread] | None = None) -> None:
        node = ray._private.worker._global_node  # None under Ray Client ("ray://")
        self.started = started
        """By a Loader: its processes are ended and its session folder removed at the end."""
        self.connected = connected
        """By a Loader, to RAY_ADDRESS: disconnected at the end."""
        self.address: str | None = getattr(node, "gcs_address", None)
        self.session: str | None = node.get_session_dir_path() if node is not None else None
        found = node.all_processes if node is not None else {}
        self._heads = [(name, info.process) for name in ("gcs_server", "raylet")
                       for info in found.get(name, [])]
        """The head's processes where this process started them (by a Loader or not)."""
        self._popens = [info.process for infos in found.values() for info in infos]
        self._owner = owner
        """The thread that started the head, and what ends it (`_start_local`)."""
        self._pid = os.getpid()
        self._processes: set[Any] = set()
        self.lost: str | None = None
        self._failing_since: float | None = None
        self._checked = 0.0
        self._probing = threading.Lock()
        self.remember()

    def __str__(self) -> str:
        return (f"the Ray instance at {self.address or '?'}"
                + (" that a Loader started" if self.started else ""))

    def remember(self) -> None:
        """Note the processes of a Ray started here, as they are now: the raylet's agents and
        workers are its children, and become init's once it is gone."""
        if not self.started:
            return
        psutil = _psutil()
        for popen in self._popens:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(popen.pid)
                self._processes.update([root, *root.children(recursive=True)])

    def check(self) -> None:
        """A LoaderError if the instance is gone: a head process started here ended, its GCS
        refuses connections, or has not answered for LOST_SECONDS. Blocking (PROBE_SECONDS at
        most)."""
        with self._probing:
            self._checked = time.monotonic()
            if self.lost is None:
                gone = self._gone()
                if gone is not None:
                    self.lost = f"{self} was lost: {gone}"
        if self.lost is not None:
            raise LoaderError(self.lost)

    async def watch(self, now: bool = False) -> None:
        """`check`, off the loop, if CHECK_SECONDS passed since the last one (or `now`)."""
        if self.lost is not None:
            raise LoaderError(self.lost)
        if now or time.monotonic() - self._checked >= CHECK_SECONDS:
            self._checked = time.monotonic()  # one check at a time from the waits on chunks
            await off_loop(self.check)

    def _gone(self) -> str | None:
        for name, popen in self._heads:
            code = popen.poll()
            if code is not None:
                return f"its {name} (pid {popen.pid}) ended ({_ended(code)})"
        if self.address is None:
            return None
        host, _, port = self.address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), PROBE_SECONDS).close()
        except ConnectionRefusedError:
            return "its GCS refuses connections"
        except OSError as e:
            since = self._failing_since = self._failing_since or time.monotonic()
            if time.monotonic() - since >= LOST_SECONDS:
                return f"its GCS did not answer for {LOST_SECONDS:g} s ({e})"
            return None
        self._failing_since = None
        return None

    def stop(self, ray: Any) -> None:
        """Let go of the instance: disconnect where a Loader connected; where one started it,
        `ray.shutdown()`, then end by pid what outlived it, and remove its session folder. Not
        in a child forked from this process (a finalizer runs there too): it is the parent's."""
        if os.getpid() != self._pid:
            return
        if self.started:
            self.remember()
        try:
            if self.started or self.connected:
                ray.shutdown()
        finally:
            if self.started:
                self._clear()

    def _clear(self) -> None:
        """What `ray.shutdown()` left of a Ray started here: its processes, ended by pid (the
        raylet's agents and workers outlive it when the raylet was killed), its session folder."""
        _end(self._processes)
        for popen in self._popens:
            popen.poll()  # reaped: no zombie left
        if self._owner is not None:
            done, thread = self._owner
            done.set()
            thread.join(STOP_SECONDS)
        if self.session is not None:
            latest = os.path.join(os.path.dirname(self.session), "session_latest")
            ours = os.path.realpath(latest) == os.path.realpath(self.session)
            shutil.rmtree(self.session, ignore_errors=True)
            if ours:
                with contextlib.suppress(OSError):
                    os.unlink(latest)


_lock = threading.Lock()
_users = 0
"""Loaders using Ray in this process."""
_instance: Instance | None = None
"""The instance they use."""


def use_ray(ray: Any) -> Instance:
    """The instance for one more Loader: the first finds the one the process holds, connects to
    RAY_ADDRESS, or else starts one of its own (`address="local"`: never one found running)."""
    global _users, _instance
    with _lock:
        if _instance is None:
            address = os.environ.get("RAY_ADDRESS") or "local"
            if ray.is_initialized():
                _instance = Instance(ray, started=False, connected=False)
            elif address == "local":
                owner = _start_local(ray)
                _instance = Instance(ray, started=True, connected=False, owner=owner)
            else:
                ray.init(address=address, configure_logging=False)
                _instance = Instance(ray, started=False, connected=True)
        _users += 1
        return _instance


def _start_local(ray: Any) -> tuple[threading.Event, threading.Thread]:
    """`ray.init(address="local")` on a thread that lasts until the event is set: Ray has Linux
    kill the head's processes when the thread that started them ends (PR_SET_PDEATHSIG), and
    the threads that run a Loader's blocking calls are short-lived. Started from one of them,
    the head was gone as soon as the first pass began, its GCS with it: Ray ended the process
    60 s later, and the raylet's agents and workers lingered as orphans."""
    ready, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def own() -> None:
        try:
            ray.init(address="local", include_dashboard=False, configure_logging=False,
                     _system_config=dict(LOCAL_CONFIG))  # Ray adds this session's folders
        except BaseException as e:
            failed.append(e)
            return
        finally:
            ready.set()
        done.wait()

    thread = threading.Thread(target=own, name="aioloader-ray", daemon=True)
    thread.start()
    if not ready.wait(START_SECONDS):
        raise LoaderError(f"a local Ray instance did not start within {START_SECONDS:g} s")
    if failed:
        raise failed[0]
    return done, thread


def let_go_of_ray(ray: Any) -> None:
    """One Loader fewer: after the last, the instance is let go of (`Instance.stop`)."""
    global _users, _instance
    with _lock:
        _users -= 1
        if _users == 0 and _instance is not None:
            instance, _instance = _instance, None
            instance.stop(ray)


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
    its last Loader closes, Ray the process held is left so."""

    on_deadline = "its Ray actor was killed and replaced"

    def __init__(self, executor: str, spec: DecodeSpec, workers: int) -> None:
        self._ray = import_ray()
        self._spec = pack_spec(spec)
        self._count = workers
        self._actors: list[Any] = []
        self._where: list[str] = []
        self._busy: list[int] = []
        self._replacing: dict[int, Future[None]] = {}
        self._instance: Instance | None = None
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
            if self._instance is None:
                self._instance = use_ray(ray)
            self._instance.check()
            cpus = ray.cluster_resources().get("CPU", 0)
            if cpus < self._count:
                raise LoaderError(f"the Ray cluster has {cpus:g} CPUs: too few for "
                                  f"num_workers={self._count} actors of one CPU each")
            self._spec_ref = ray.put(self._spec)
            actors = [self._new_actor() for _ in range(self._count)]
            try:
                self._where = self._get([a.where.remote() for a in actors])
            except BaseException as e:
                if self._instance.lost is None:
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
            self._instance.remember()

    def _get(self, refs: list[Any]) -> list[Any]:
        """`ray.get` within START_SECONDS, the instance checked every CHECK_SECONDS: one that is
        gone is a LoaderError at once, not a wait for the deadline."""
        ray = self._ray
        assert self._instance is not None
        deadline = time.monotonic() + START_SECONDS
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=CHECK_SECONDS)
            if len(ready) == len(refs):
                return list(ray.get(refs))
            self._instance.check()
            if time.monotonic() > deadline:
                raise ray.exceptions.GetTimeoutError(f"not ready within {START_SECONDS:g} s")

    def slots(self) -> int:
        return self._count

    async def run(self, task: RemoteTask) -> ChunkResult:
        instance = self._instance
        assert instance is not None
        await instance.watch()
        number = await self._pick()
        task.handle, task.where = number, f"Ray actor {number} ({self._where[number]})"
        self._busy[number] += 1
        try:
            return await self._decode(instance, self._actors[number], task.chunk)
        except asyncio.CancelledError:
            self._retire(number)  # left busy with the chunk
            raise
        except LoaderError:  # the instance is gone
            raise
        except Exception as e:
            await instance.watch(now=True)  # the whole instance may be gone, not the actor
            if isinstance(e, self._ray.exceptions.RayActorError):
                self._retire(number)
            raise
        finally:
            self._busy[number] -= 1

    @staticmethod
    async def _decode(instance: Instance, actor: Any, chunk: Chunk) -> ChunkResult:
        """The actor's result, the instance checked meanwhile (Ray's calls to an actor may go
        on working a while after the head is gone)."""
        call = asyncio.ensure_future(actor.decode.remote(chunk))
        try:
            while not call.done():
                await asyncio.wait({call}, timeout=CHECK_SECONDS)
                if not call.done():
                    await instance.watch()
        finally:
            call.cancel()
        result: ChunkResult = call.result()
        return result

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
        """Kill the actor (if it still lives) and start another in its place, unless the
        instance is gone."""
        ray = self._ray
        try:
            with self._lock:
                if not self._actors or self._instance is None:
                    return  # closed meanwhile
                self._instance.check()
                ray.kill(self._actors[number], no_restart=True)
                fresh = self._new_actor()
                self._where[number] = self._get([fresh.where.remote()])[0]
                self._actors[number] = fresh
                self._instance.remember()
        finally:
            self._replacing.pop(number, None)

    def _new_actor(self) -> Any:
        return self._ray.remote(num_cpus=1, max_restarts=0)(DecodeActor).remote(self._spec_ref)

    def close(self) -> None:
        ray = self._ray
        with self._lock:
            actors, self._actors = self._actors, []
            instance, self._instance = self._instance, None
            if instance is not None and instance.lost is None:
                for actor in actors:
                    ray.kill(actor, no_restart=True)
        if instance is not None:
            let_go_of_ray(ray)
