"""Where a pass's chunks are decoded: inline (num_workers=0), or in the decode pool, with
deadlines and recovery from processes that die (an executor or a cluster: `remote`)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import signal
import threading
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Protocol

from .._blocking import off_loop
from .._errors import (
    DecodeTimeoutError,
    LoaderError,
    RemoteTraceback,
    WorkerDiedError,
    named_type,
    typed,
)
from .._ipc.messages import Chunk, ChunkResult, Done, InitFailed, Ready, Task
from .._processes.pool import LOST, DecodePool, DecodeProcess
from .._stats import now
from .._tasks import TaskSet
from .._worker.decode import DecodeSpec, respond, run_chunk

PER_PROCESS = 2
"""Chunks queued at a decode process: one running, one waiting, so it never idles between."""
STATUS_WAIT = 5.0


@dataclass
class Recovery:
    """The rules for a chunk past its deadline and a worker that died, written once for the
    pool and every backend (`remote.RemoteDecoder`): a worker lost is replaced and its chunk
    sent again, up to `max_restarts` per pass; a chunk that killed two workers is not sent a
    third time; a chunk given up on fails, or has its samples skipped."""

    decode_timeout: float | None
    max_restarts: int
    """Workers lost per pass before the pass fails."""
    skip_errors: bool
    """A chunk given up on has its samples skipped instead of raising."""
    on_restart: Callable[[str], None]
    """Told why, each time a worker was lost and its chunks sent again."""
    on_timeout: Callable[[], None] | None = None
    """Told of each chunk given up on at its deadline, for the loader's stats."""
    restarts: int = 0
    """Workers lost in this pass."""

    def worker_lost(self, worker: str, cause: str, indices: list[int], again: str
                    ) -> WorkerDiedError | None:
        """Count `worker` lost (`cause`) while it decoded `indices`: the error that ends the
        pass once past `max_restarts`; else None, having told that `again` happens."""
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return WorkerDiedError(
                f"{worker} ended abruptly ({cause}) while decoding samples {short_list(indices)}"
                f", after {self.max_restarts} restarts in this pass (max_worker_restarts); the "
                "OOM killer or a crash in native code are the usual causes")
        self.on_restart(f"{worker} ended abruptly ({cause}); {again}")
        return None

    def killed_twice(self, chunk: Chunk, worker: str, cause: str) -> ChunkResult | Exception:
        """A chunk whose second worker died under it: not sent again."""
        return self.give_up(chunk, WorkerDiedError(
            f"samples {short_list(chunk.indices)} killed a {worker} twice ({cause}); they are "
            "not sent again"), f"killed a {worker} twice ({cause})")

    def past_deadline(self, chunk: Chunk, where: str, then: str) -> ChunkResult | Exception:
        """A chunk that ran past `decode_timeout` `where`; `then`: what became of its worker."""
        assert self.decode_timeout is not None
        if self.on_timeout is not None:
            self.on_timeout()
        return self.give_up(chunk, DecodeTimeoutError(
            f"decoding samples {short_list(chunk.indices)} took longer than "
            f"decode_timeout={self.decode_timeout:g} s {where}; {then}"
        ), f"decode took longer than decode_timeout={self.decode_timeout:g} s")

    def give_up(self, chunk: Chunk, error: Exception, reason: str) -> ChunkResult | Exception:
        """A chunk that will not be decoded: all its samples skipped, or its error."""
        if not self.skip_errors:
            return error
        return ChunkResult([], [(n, reason) for n in range(len(chunk.indices))])


def short_list(values: list[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


class Decoder(Protocol):
    lends_late: bool
    """It calls a chunk's `on_send` as the chunk goes to a process: the pass lends the block
    then. Otherwise the block is lent before the chunk is given to the decoder."""

    async def decode(self, chunk: Chunk) -> ChunkResult: ...

    def in_flight(self) -> list[tuple[float, str]]:
        """(seconds running, what) of the chunks being decoded, for the stall watchdog."""
        ...

    def abandon(self) -> None:
        """The pass was dropped: let go at once, without awaiting."""
        ...

    async def aclose(self) -> None:
        """The pass ends: let go; once this returns, no process still writes for the pass."""
        ...


class _HoldsNothing:
    """A decoder with no processes of its own: nothing to watch or to release."""

    lends_late = False

    def in_flight(self) -> list[tuple[float, str]]:
        return []

    def abandon(self) -> None:
        return

    async def aclose(self) -> None:
        return


class InlineDecoder(_HoldsNothing):
    """Decode in the event loop's thread: num_workers=0 (for debugging with pdb), or nothing
    to decode. With a block lent (a loader service), the batch is collated into it, for the
    training process to map."""

    def __init__(self, spec: DecodeSpec) -> None:
        self._spec = spec

    async def decode(self, chunk: Chunk) -> ChunkResult:
        return respond(self._spec, chunk) if chunk.slot is not None else run_chunk(
            self._spec, chunk)


@dataclass(eq=False)
class _Job:
    id: int
    chunk: Chunk
    future: asyncio.Future[ChunkResult]
    deaths: int = 0
    started: float = field(default=0.0)
    """When its process began it (it reached the head of that process's queue)."""


def describe_exit(status: int | None) -> str:
    if status is None:
        return "exit status unknown"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit code {status}"


class PoolDecoder:
    """A pass's hold on the decode pool (or, in a node's loader service, every rank's).

    Chunks go to the least busy process, at most PER_PROCESS each; the waiting chunk of the
    earliest step goes first, so of several passes the one furthest behind is served first.
    A chunk running longer than `decode_timeout` gets its process killed and fails (or,
    skipping errors, is skipped). A process that dies is replaced and its chunks are sent
    again, in order, up to `max_restarts` times per pass; a chunk that was running when a
    process died twice is not sent a third time (a poison chunk). Every sample still comes
    out once, with the same rng.
    """

    lends_late = True

    def __init__(
        self,
        get_pool: Callable[[], DecodePool],
        owns_pool: bool,
        recovery: Recovery,
    ) -> None:
        self._get_pool = get_pool
        self._owns_pool = owns_pool
        self._pool_or_none: DecodePool | None = None
        self.recovery = recovery
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count()
        self._waiting: list[tuple[int, int, int, _Job]] = []
        """Chunks not sent yet, a heap by (epoch, step, arrival)."""
        self._assigned: dict[int, deque[_Job]] = {}
        """Per process id: the chunks sent to it, in the order it runs them."""
        self._failure: BaseException | None = None
        self._tasks = TaskSet()
        self.on_ignored: Callable[[Chunk], None] | None = None
        """Told of each chunk whose result came after its pass gave up on it."""
        self._let_go = False
        self._decoded_any = False
        self._iterating = False
        """Chunks went to chosen workers (an IterableDataset's): a process that ends takes its
        iterator's place with it, so the pass cannot go on."""
        self._starting = self._loop.create_task(self._start(), name="aioloader-pool-start")

    async def _start(self) -> None:
        """Get the pool (starting its processes off the loop, while the pass already reads),
        and replace processes that a previous pass left dead or retired."""
        pool = await off_loop(self._get_pool)
        if self._let_go:  # the pass was dropped while the processes started
            if self._owns_pool:
                threading.Thread(target=pool.close, name="aioloader-pool-close",
                                 daemon=True).start()
            return
        self._pool_or_none = pool
        pool.listen(self._on_message, self._loop)
        if self.recovery.decode_timeout is not None:
            self._tasks.start(self._watch_deadlines())
        for process in list(pool.processes):
            if process.retired or not process.alive:
                await off_loop(pool.replace, process)
        self._dispatch()

    @property
    def failure(self) -> BaseException | None:
        """What ended this decoder's work: its processes did not start, worker_init failed,
        or too many died."""
        starting = self._starting
        if starting.done() and not starting.cancelled() and starting.exception() is not None:
            return starting.exception()
        return self._failure

    @property
    def _pool(self) -> DecodePool:
        assert self._pool_or_none is not None, "the pool is used only once it is up"
        return self._pool_or_none

    async def decode(self, chunk: Chunk) -> ChunkResult:
        await asyncio.shield(self._starting)  # raises if the processes could not start
        if self._failure is not None:
            raise self._failure
        job = _Job(next(self._ids), chunk, self._loop.create_future())
        self._wait(job)
        self._dispatch()
        return await job.future

    def _dispatch(self) -> None:
        """Send waiting chunks to the least busy processes. Until the first chunk this decoder
        sends comes back (a pass's first, as each pass has its own; a node's service shares
        one among its ranks), a process still starting counts as a candidate that is not
        ready yet: a chunk waits for it rather than queueing behind a busy one, so the first
        chunks (a divided first batch) go to every process at once. Later (a process replaced
        after a crash), the ready ones keep two chunks each. A chunk for one worker (an
        IterableDataset's) waits for that process, and the chunks after it may go first."""
        live = [p for p in self._pool.processes
                if p.alive and not p.retired and (p.ready or not self._decoded_any)]
        held_back = []
        while self._waiting and live:
            entry = heapq.heappop(self._waiting)
            job = entry[3]
            if job.future.done():
                continue  # its batch was given up on
            worker = job.chunk.worker
            fit = [p for p in live if worker is None or p.id == worker]
            process = min(fit, key=lambda p: (len(self._assigned.setdefault(p.id, deque())),
                                              not p.ready), default=None)
            queue = self._assigned[process.id] if process is not None else deque()
            if process is None or len(queue) >= PER_PROCESS or not process.ready:
                held_back.append(entry)
                if worker is None:
                    break
                continue
            if worker is not None:
                self._iterating = True
            if not queue:
                job.started = now()
            queue.append(job)
            if job.chunk.on_send is not None:
                job.chunk.on_send(job.chunk)
            process.send(Task(job.id, job.chunk))
        for entry in held_back:
            heapq.heappush(self._waiting, entry)

    def _on_message(self, process: DecodeProcess, message: object) -> None:
        if process.retired or process is not self._pool.processes[process.id]:
            return  # left by an earlier pass, or replaced meanwhile: its chunks went elsewhere
        if self._pool.closed:
            return
        if isinstance(message, Done):
            self._decoded_any = True
            queue = self._assigned[process.id]
            job = next((j for j in queue if j.id == message.id), None)
            if job is not None:
                queue.remove(job)
                if not job.future.done():
                    job.future.set_result(message.result)
                elif self.on_ignored is not None:
                    self.on_ignored(job.chunk)
            if queue and not queue[0].started:
                queue[0].started = now()
            self._dispatch()
        elif isinstance(message, Ready):
            self._dispatch()
        elif isinstance(message, InitFailed):
            error = typed(LoaderError, named_type(message.kind))(
                f"worker_init failed in {process}: {message.reason}")
            error.__cause__ = RemoteTraceback(message.traceback)
            self._fail(error)
        elif message == LOST:
            self._tasks.start(self._lost(process))

    def _fail(self, error: BaseException, lost: list[_Job] | None = None) -> None:
        """Nothing more can be decoded in this pass: every chunk waiting, sent or `lost` gets
        `error`."""
        if self._failure is None:
            self._failure = error
        jobs = [*(lost or []), *self._jobs()]
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)
        self._waiting.clear()

    async def _lost(self, process: DecodeProcess) -> None:
        """A process died: replace it and send its chunks again (or give up, past the budget)."""
        if self._failure is not None:
            return
        jobs = list(self._assigned.pop(process.id, ()))
        status = await off_loop(self._pool.exit_status, process, STATUS_WAIT)
        cause = describe_exit(status)
        if self._iterating:
            self._fail(WorkerDiedError(
                f"{process} ended ({cause}) while it iterated its copy of the IterableDataset: "
                "where its iterator stood is lost with it, so this pass cannot go on without "
                "repeating or losing items"), jobs)
            return
        failure = self.recovery.worker_lost(
            str(process), cause, jobs[0].chunk.indices if jobs else [],
            f"restarted it and sent its {len(jobs)} chunk(s) again")
        if failure is not None:
            self._fail(failure, jobs)
            return
        if jobs:
            head = jobs[0]
            head.deaths += 1
            if head.deaths >= 2:
                jobs.pop(0)
                _settle(head, self.recovery.killed_twice(head.chunk, "decode process", cause))
        for job in jobs:
            self._wait(job)
        await self._replace(process)

    async def _replace(self, process: DecodeProcess) -> None:
        if self._pool.processes[process.id] is not process:
            return  # replaced already
        try:
            fresh = await off_loop(self._pool.replace, process)
        except LoaderError:
            return  # the pool closed meanwhile: the pass is over
        self._assigned.setdefault(fresh.id, deque())  # Ready may have come, and chunks with it
        self._dispatch()

    async def _watch_deadlines(self) -> None:
        assert self.recovery.decode_timeout is not None
        while True:
            await asyncio.sleep(min(self.recovery.decode_timeout / 4, 0.5))
            moment = now()
            for process in list(self._pool.processes):
                queue = self._assigned.get(process.id)
                if not queue or not queue[0].started:
                    continue
                if moment - queue[0].started > self.recovery.decode_timeout:
                    self._time_out(process, queue)

    def _time_out(self, process: DecodeProcess, queue: deque[_Job]) -> None:
        process.retire()  # no more chunks for it; its end is not a crash
        head = queue.popleft()
        self._assigned.pop(process.id, None)
        _settle(head, self.recovery.past_deadline(head.chunk, f"in {process}",
                                                  "the process was killed"))
        for job in queue:
            self._wait(job)
        self._tasks.start(self._replace(process))

    def _wait(self, job: _Job) -> None:
        """Queue a job to be sent (again: its place is its step, so it goes first again)."""
        job.started = 0.0
        heapq.heappush(self._waiting, (job.chunk.epoch, job.chunk.step, job.id, job))

    def _jobs(self) -> list[_Job]:
        """Every job waiting or sent."""
        return [*(entry[3] for entry in self._waiting),
                *(j for q in self._assigned.values() for j in q)]

    def in_flight(self, chunks: Container[int] | None = None) -> list[tuple[float, str]]:
        """Chunks running (only those whose id() is in `chunks`, if given), for a watchdog."""
        if self._pool_or_none is None:
            return []
        moment = now()
        return [
            (moment - queue[0].started, f"samples {short_list(queue[0].chunk.indices)} in "
             f"{self._pool.processes[worker_id]}")
            for worker_id, queue in self._assigned.items()
            if queue and queue[0].started and (chunks is None or id(queue[0].chunk) in chunks)
        ]

    def _release(self) -> list[DecodeProcess]:
        """Stop listening; kill the processes still holding chunks of this pass."""
        self._let_go = True
        self._tasks.cancel_all()
        for job in self._jobs():
            job.future.cancel()
        pool = self._pool_or_none
        if pool is None:
            return []
        pool.listen(None)
        busy = [pool.processes[i] for i, queue in self._assigned.items() if queue]
        for process in busy:
            process.retire()
        return busy

    def abandon(self) -> None:
        self._release()
        pool = self._pool_or_none
        if self._owns_pool and pool is not None:
            threading.Thread(target=pool.close, name="aioloader-pool-close", daemon=True).start()

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):  # let a start under way finish: it owns a pool
            await asyncio.shield(self._starting)
        busy = self._release()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for process in busy:  # its blocks may be dropped only once it surely stopped writing
            await off_loop(self._pool.exit_status, process, STATUS_WAIT)
        if self._owns_pool and self._pool_or_none is not None:
            await off_loop(self._pool_or_none.close)


def _settle(job: _Job, outcome: ChunkResult | Exception) -> None:
    if not job.future.done():
        if isinstance(outcome, Exception):
            job.future.set_exception(outcome)
        else:
            job.future.set_result(outcome)


class SharedDecoder:
    """One pass's use of a decoder that serves several passes at once (the ranks of a node).

    A chunk the pass gives up on (a `break`, an error) is cancelled: not sent if it still
    waits, its result ignored if a process runs it. Closing the pass stops no process: the
    others' chunks run on.
    """

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self.lends_late = decoder.lends_late
        self._chunks: set[int] = set()

    async def decode(self, chunk: Chunk) -> ChunkResult:
        self._chunks.add(id(chunk))
        try:
            return await self._decoder.decode(chunk)
        finally:
            self._chunks.discard(id(chunk))

    def in_flight(self) -> list[tuple[float, str]]:
        if isinstance(self._decoder, PoolDecoder):
            return self._decoder.in_flight(self._chunks)
        return []

    def abandon(self) -> None:
        return

    async def aclose(self) -> None:
        return
