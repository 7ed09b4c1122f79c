"""The runtime's stages (a pass, its hand-over, the hold on the decode pool) against a fake source,
decoder and pool, as their Protocols allow: no network and no processes, so the order of events
is set by the test (gates it opens) and never by timing."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aioloader._errors import LoaderError, SampleError, StallError, WorkerDiedError
from aioloader._ipc.messages import Chunk, ChunkResult, Done, Task
from aioloader._pass.budget import MemoryBudget
from aioloader._pass.feeds import Pending, Work
from aioloader._pass.handover import Handover
from aioloader._pass.pipeline import END, Pass, PassConfig
from aioloader._processes.pool import LOST
from aioloader._scheduling.decoders import PER_PROCESS, PoolDecoder, Recovery
from aioloader._stats import LoaderStats, now
from aioloader._worker.decode import join_results

BATCH = 2
"""Samples per batch; one batch per chunk."""
WAIT = 10.0
"""The bound on every wait: far above what any of them takes."""


async def until(condition: Callable[[], bool]) -> None:
    """Wait, bounded, until `condition` holds."""

    async def poll() -> None:
        while True:
            if condition():
                return
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), WAIT)


async def settle() -> None:
    """Let every task that can run, run (none of the fakes sleeps)."""
    for _ in range(50):
        await asyncio.sleep(0)


class FakeSource:
    """`chunks` chunks of BATCH samples (chunk c holds samples 2c and 2c + 1), read one chunk at
    a time. A read waits for its gate when it has one (a gate never opened: a read that never
    ends); `failures` are fetch failures of a chunk; `crash_after` ends the feed with an error."""

    def __init__(self, chunks: int, raw_size: int = 100, crash_after: int | None = None) -> None:
        self.chunks = chunks
        self.raw_size = raw_size
        self.crash_after = crash_after
        self.gates: dict[int, asyncio.Event] = {}
        self.failures: dict[int, BaseException] = {}
        self.read = 0
        """Chunks read and handed to the decode stage."""
        self.blocked_at: list[int] = []
        """Chunks before which room() blocked."""
        self.blocked = asyncio.Event()
        self.cancelled = False
        self._reading: tuple[float, str] | None = None

    async def feed(self, work: Work) -> None:
        try:
            for c in range(self.chunks):
                if c == self.crash_after:
                    raise OSError(f"the source broke before chunk {c}")
                indices = [c * BATCH + n for n in range(BATCH)]
                pending = Pending(c, 1, indices, [None] * BATCH, missing=BATCH)
                if not work.has_room():
                    self.blocked_at.append(c)
                    self.blocked.set()
                await work.room()
                work.reading(pending, BATCH)
                if c in self.gates:
                    what = f"the read of sample {indices[0]} (sample-{indices[0]})"
                    self._reading = (now(), what)
                    await self.gates[c].wait()
                    self._reading = None
                for position in range(BATCH):
                    raw = bytes(self.raw_size)
                    pending.raws[position] = raw
                    work.hold(pending, raw)
                pending.missing = 0
                pending.failure = self.failures.get(c)
                self.read += 1
                work.complete(pending)
        except asyncio.CancelledError:
            self.cancelled = True
            raise

    def position(self, steps_done: int) -> int:
        return steps_done * BATCH

    def key(self, pending: Pending, position: int) -> str:
        return f"sample-{pending.indices[position]}"

    def oldest_read(self) -> tuple[float, str] | None:
        if self._reading is None:
            return None
        started, what = self._reading
        return now() - started, what


class FakeDecoder:
    """Decodes chunk c into the batch ("batch", c) once its gate (if any) is open, or raises
    `failures[c]`; counts the chunks it decodes at once and what it is told."""

    shared = False
    lends_late = False

    def __init__(self) -> None:
        self.gates: dict[int, asyncio.Event] = {}
        self.failures: dict[int, BaseException] = {}
        self.done: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        """Set when chunk c's decode ended, well or not."""
        self.running: dict[int, float] = {}
        self.most_running = 0
        self.started: list[int] = []
        self.cancelled: list[int] = []
        self.closed = False
        self.abandoned = False

    async def decode(self, chunk: Chunk) -> ChunkResult:
        c = chunk.indices[0] // BATCH
        self.started.append(c)
        self.running[c] = now()
        self.most_running = max(self.most_running, len(self.running))
        try:
            if c in self.gates:
                await self.gates[c].wait()
            if c in self.failures:
                raise self.failures[c]
            return ChunkResult([("batch", c)], [])
        except asyncio.CancelledError:
            self.cancelled.append(c)
            raise
        finally:
            del self.running[c]
            self.done[c].set()

    def in_flight(self) -> list[tuple[float, str]]:
        return [(now() - started, f"chunk {c}") for c, started in self.running.items()]

    def abandon(self) -> None:
        self.abandoned = True

    async def aclose(self) -> None:
        self.closed = True


class FakeStorage:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


def make_pass(
    source: FakeSource,
    decoder: FakeDecoder,
    ordered: bool = True,
    memory_limit: int = 1 << 40,
    decode_window: int = 8,
    stall_timeout: float = 600.0,
    storage: FakeStorage | None = None,
    start_chunks: int = 8,
    sample_bytes: float | None = 0.0,
) -> Pass:
    """A pass as the loader's `_build_pass` makes one, over the fakes. `sample_bytes`: what
    earlier passes learnt a decoded sample holds (None: nothing, as in a loader's first)."""
    config = PassConfig(
        epoch=0, batch_size=BATCH, steps_per_chunk=1, ordered=ordered, skip_errors=False,
        memory_limit=memory_limit, read_ahead=1000, decode_window=decode_window,
        stall_timeout=stall_timeout, start_chunks=start_chunks,
    )
    budget = MemoryBudget(memory_limit)
    budget.sample_bytes = sample_bytes
    return Pass(config, source, decoder, None, LoaderStats(),
                storage or FakeStorage(),  # type: ignore[arg-type]
                lambda start_task: start_task(), budget=budget)


async def take(running: Pass, count: int) -> list[Any]:
    return [await asyncio.wait_for(running.next(), WAIT) for _ in range(count)]


def loader_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("aioloader-")]


# -- order --------------------------------------------------------------------------------------


async def test_ordered_pass_hands_over_in_step_order_when_chunks_finish_backwards() -> None:
    source, decoder = FakeSource(4), FakeDecoder()
    for c in range(3):  # chunk 3 finishes first, then 2, 1, 0
        decoder.gates[c] = decoder.done[c + 1]
    running = make_pass(source, decoder, ordered=True)
    await running.start()
    try:
        assert await take(running, 4) == [("batch", c) for c in range(4)]
        assert await asyncio.wait_for(running.next(), WAIT) is END
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_unordered_pass_hands_over_batches_as_they_finish_not_behind_a_slow_one() -> None:
    source, decoder = FakeSource(4), FakeDecoder()
    decoder.gates[0] = asyncio.Event()
    running = make_pass(source, decoder, ordered=False)
    await running.start()
    try:
        assert sorted(await take(running, 3)) == [("batch", c) for c in (1, 2, 3)]
        decoder.gates[0].set()
        assert await take(running, 1) == [("batch", 0)]
        assert await asyncio.wait_for(running.next(), WAIT) is END
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


def test_handover_counts_only_the_contiguous_prefix_of_steps_as_done() -> None:
    handover = Handover(ordered=False)
    assert handover.steps_done(1) == 0
    assert handover.steps_done(2) == 0
    assert handover.steps_done(0) == 3


# -- failures -----------------------------------------------------------------------------------


async def test_first_failure_in_step_order_is_raised_after_the_batches_before_it() -> None:
    source, decoder = FakeSource(6), FakeDecoder()
    source.failures[2] = SampleError(4, "sample-4", "fetch", "the fake read failed")
    decoder.failures[4] = ValueError("chunk 4 is corrupt")
    decoder.gates[1] = decoder.done[4]  # chunk 4 fails before chunk 1 is decoded
    running = make_pass(source, decoder, ordered=True)
    await running.start()
    try:
        assert await take(running, 2) == [("batch", 0), ("batch", 1)]
        with pytest.raises(SampleError, match="sample-4"):
            await asyncio.wait_for(running.next(), WAIT)
        assert running.steps_done == 3
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_a_source_that_breaks_raises_after_the_batches_it_read() -> None:
    source, decoder = FakeSource(6, crash_after=3), FakeDecoder()
    running = make_pass(source, decoder)
    await running.start()
    try:
        assert await take(running, 3) == [("batch", c) for c in range(3)]
        with pytest.raises(OSError, match="before chunk 3"):
            await asyncio.wait_for(running.next(), WAIT)
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


# -- bounds -------------------------------------------------------------------------------------


@pytest.mark.parametrize("ordered", [True, False])
async def test_decode_window_bounds_the_chunks_decoding_while_the_consumer_waits(
    ordered: bool,
) -> None:
    window, chunks = 3, 10
    source, decoder = FakeSource(chunks), FakeDecoder()
    for c in range(chunks):
        decoder.gates[c] = asyncio.Event()
    running = make_pass(source, decoder, ordered=ordered, decode_window=window)
    await running.start()
    try:
        await until(lambda: len(decoder.running) == window)
        await settle()
        assert sorted(decoder.running) == list(range(window))
        for c in range(chunks):  # one at a time: the window moves, never grows
            decoder.gates[c].set()
            assert await take(running, 1) == [("batch", c)]
            await settle()
        assert decoder.most_running == window
        assert await asyncio.wait_for(running.next(), WAIT) is END
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_a_first_pass_decodes_one_chunk_until_it_knows_what_a_chunk_holds() -> None:
    source, decoder = FakeSource(6), FakeDecoder()
    for c in range(6):
        decoder.gates[c] = asyncio.Event()
    running = make_pass(source, decoder, decode_window=4, sample_bytes=None)
    await running.start()
    try:
        await until(lambda: len(decoder.running) == 1)
        await settle()
        assert list(decoder.running) == [0]  # the others wait to learn what a decoded chunk holds
        decoder.gates[0].set()
        await until(lambda: len(decoder.running) == 3)  # then a window at once, within the room
        for c in range(6):
            decoder.gates[c].set()
        assert await take(running, 6) == [("batch", c) for c in range(6)]
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_memory_limit_stops_the_source_until_the_consumer_takes_batches() -> None:
    chunks, raw_size = 8, 1000
    source, decoder = FakeSource(chunks, raw_size=raw_size), FakeDecoder()
    for c in range(chunks):
        decoder.gates[c] = asyncio.Event()
    # two chunks read plus a decode window (two chunks) of results reach the limit
    running = make_pass(source, decoder, memory_limit=4 * BATCH * raw_size, decode_window=2)
    await running.start()
    try:
        await asyncio.wait_for(source.blocked.wait(), WAIT)
        await settle()
        assert source.read < chunks
        read_when_blocked = source.read
        for c in range(chunks):
            decoder.gates[c].set()
        assert await take(running, chunks) == [("batch", c) for c in range(chunks)]
        assert source.read == chunks > read_when_blocked
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_memory_limit_never_stops_a_source_far_below_it() -> None:
    source, decoder = FakeSource(8), FakeDecoder()
    running = make_pass(source, decoder)
    await running.start()
    try:
        assert len(await take(running, 8)) == 8
        assert source.blocked_at == []
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


class ReadsInTasks(FakeSource):
    """Starts each chunk's read in a task and asks for room for the next one at once, as the
    loader's own source does; chunk 0's read waits for `first_read`."""

    def __init__(self, chunks: int) -> None:
        super().__init__(chunks)
        self.first_read = asyncio.Event()
        self.room_for: list[int] = []

    async def feed(self, work: Work) -> None:
        reads = []
        for c in range(self.chunks):
            await work.room()
            self.room_for.append(c)
            pending = Pending(c, 1, [c * BATCH + n for n in range(BATCH)], [None] * BATCH,
                              missing=BATCH)
            work.reading(pending, BATCH)
            reads.append(asyncio.create_task(self._read(pending, work)))
        await asyncio.gather(*reads)

    async def _read(self, pending: Pending, work: Work) -> None:
        if pending.first_step == 0:
            await self.first_read.wait()
        pending.raws = [bytes(self.raw_size)] * BATCH
        pending.missing = 0
        work.hold_all(pending, pending.raws)
        work.complete(pending)


async def test_reading_ahead_goes_on_once_the_first_chunk_is_in_not_once_it_is_decoded() -> None:
    """Before any sample's size is known a pass reads one chunk; when it comes in, the reads
    waiting for room go on while it decodes (they waited for its decode: a whole chunk's
    decode time at the start of every pass, with one decode process busy)."""
    source, decoder = ReadsInTasks(4), FakeDecoder()
    decoder.gates[0] = asyncio.Event()
    running = make_pass(source, decoder)
    await running.start()
    try:
        await settle()
        assert source.room_for == [0]  # nothing known yet: one chunk at a time
        source.first_read.set()
        await until(lambda: source.room_for == [0, 1, 2, 3])
        assert 0 in decoder.running  # chunk 0 is still decoding
        decoder.gates[0].set()
        assert await take(running, 4) == [("batch", c) for c in range(4)]
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_until_the_first_chunk_is_decoded_reads_go_only_start_chunks_ahead() -> None:
    """Reading far ahead at the start would take the cores from the first batch's decode:
    the first chunk, and one for each decode process to go on with, are read."""
    source, decoder = FakeSource(20), FakeDecoder()
    for c in range(20):
        decoder.gates[c] = asyncio.Event()
    running = make_pass(source, decoder, decode_window=8, start_chunks=3)  # read_ahead: 1000
    await running.start()
    try:
        await asyncio.wait_for(source.blocked.wait(), WAIT)
        await settle()
        assert source.read == 3  # chunks: start_chunks, though the window holds 8
        decoder.gates[0].set()
        await until(lambda: source.read == 20)  # then as far as read_ahead allows
        for gate in decoder.gates.values():
            gate.set()
        assert len(await take(running, 20)) == 20
        assert source.blocked_at == [3]
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


# -- the watchdog -------------------------------------------------------------------------------


async def test_stall_watchdog_names_the_sources_oldest_read_when_nothing_moves() -> None:
    source, decoder = FakeSource(4), FakeDecoder()
    source.gates[1] = asyncio.Event()  # a read that never ends
    running = make_pass(source, decoder, stall_timeout=0.3)
    await running.start()
    try:
        assert await take(running, 1) == [("batch", 0)]
        with pytest.raises(StallError, match=r"stall_timeout=0\.3.*read of sample 2 \(sample-2\)"):
            await asyncio.wait_for(running.next(), WAIT)
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


async def test_stall_watchdog_names_a_decode_that_never_ends() -> None:
    source, decoder = FakeSource(2), FakeDecoder()
    decoder.gates[0] = asyncio.Event()
    running = make_pass(source, decoder, stall_timeout=0.3)
    await running.start()
    try:
        with pytest.raises(StallError, match="chunk 0 has been in flight"):
            await asyncio.wait_for(running.next(), WAIT)
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


# -- letting go ---------------------------------------------------------------------------------


async def test_aclose_cancels_reads_and_decodes_and_closes_the_decoder() -> None:
    source, decoder, storage = FakeSource(6), FakeDecoder(), FakeStorage()
    decoder.gates[0] = asyncio.Event()
    source.gates[2] = asyncio.Event()
    running = make_pass(source, decoder, storage=storage)
    await running.start()
    consumer = asyncio.create_task(running.next())
    await until(lambda: 0 in decoder.running and source.oldest_read() is not None)
    await asyncio.wait_for(running.aclose(), WAIT)
    assert decoder.closed and source.cancelled and decoder.cancelled == [0]
    assert storage.closed
    assert all(task.done() for task in loader_tasks())
    with pytest.raises(LoaderError, match="closed"):
        await asyncio.wait_for(consumer, WAIT)
    await asyncio.wait_for(running.aclose(), WAIT)  # again: nothing to do


async def test_abandon_lets_go_without_awaiting_and_cancels_every_task() -> None:
    source, decoder, storage = FakeSource(6), FakeDecoder(), FakeStorage()
    decoder.gates[0] = asyncio.Event()
    source.gates[2] = asyncio.Event()
    running = make_pass(source, decoder, storage=storage)
    await running.start()
    await until(lambda: 0 in decoder.running and source.oldest_read() is not None)
    running.abandon()  # not awaited: it runs where nothing can be (a generator's __del__)
    assert decoder.abandoned
    await until(lambda: all(task.done() for task in loader_tasks()))
    await until(lambda: storage.closed)
    assert source.cancelled and decoder.cancelled == [0]
    with pytest.raises(LoaderError, match="abandoned"):
        await asyncio.wait_for(running.next(), WAIT)
    await asyncio.wait_for(running.aclose(), WAIT)
    assert not decoder.closed  # abandoned once: a later aclose does not let go twice


async def test_position_after_a_break_counts_the_batches_handed_over() -> None:
    source, decoder = FakeSource(6), FakeDecoder()
    running = make_pass(source, decoder)
    await running.start()
    try:
        await take(running, 3)
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)
    assert (running.steps_done, running.position) == (3, 3 * BATCH)


async def test_position_out_of_order_waits_for_the_batch_not_yet_handed_over() -> None:
    source, decoder = FakeSource(4), FakeDecoder()
    decoder.gates[0] = asyncio.Event()
    running = make_pass(source, decoder, ordered=False)
    await running.start()
    try:
        await take(running, 2)
        assert (running.steps_done, running.position) == (0, 0)
        decoder.gates[0].set()
        await until(lambda: 0 not in decoder.running)
        assert await take(running, 1) == [("batch", 0)]
        assert (running.steps_done, running.position) == (3, 3 * BATCH)
        assert await take(running, 1) == [("batch", 3)]
        assert running.steps_done == 4
    finally:
        await asyncio.wait_for(running.aclose(), WAIT)


# -- the hold on the decode pool, over a fake pool ----------------------------------------------


class FakeProcess:
    """A decode process as PoolDecoder sees it: the tasks sent to it, answered by the test."""

    def __init__(self, pool: FakePool, worker_id: int) -> None:
        self.pool = pool
        self.id = worker_id
        self.ready = True
        self.alive = True
        self.retired = False
        self.queue: list[Task] = []
        self.most_queued = 0

    def __repr__(self) -> str:
        return f"fake process {self.id}"

    def send(self, task: Task) -> None:
        self.queue.append(task)
        self.most_queued = max(self.most_queued, len(self.queue))

    def retire(self) -> None:
        self.retired = True

    def answer(self) -> None:
        """Decode the head of the queue: its batch is the chunk's indices."""
        task = self.queue.pop(0)
        self.pool.deliver(self, Done(task.id, ChunkResult([tuple(task.chunk.indices)], [])))

    def die(self) -> None:
        self.alive = False
        self.pool.deliver(self, LOST)


class FakePool:
    def __init__(self, size: int) -> None:
        self.processes = [FakeProcess(self, n) for n in range(size)]
        self.closed = False
        self.listener: tuple[asyncio.AbstractEventLoop, Any] | None = None

    def listen(self, listener: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.listener = None if listener is None or loop is None else (loop, listener)

    def deliver(self, process: FakeProcess, message: object) -> None:
        assert self.listener is not None
        loop, listener = self.listener
        loop.call_soon_threadsafe(listener, process, message)

    def replace(self, process: FakeProcess) -> FakeProcess:
        fresh = FakeProcess(self, process.id)
        self.processes[process.id] = fresh
        return fresh

    @staticmethod
    def exit_status(process: FakeProcess, wait: float) -> int:
        return -9

    def close(self) -> None:
        self.closed = True


def pool_decoder(pool: FakePool, restarts: list[str]) -> PoolDecoder:
    return PoolDecoder(lambda: pool, owns_pool=True,  # type: ignore[arg-type,return-value]
                       recovery=Recovery(decode_timeout=None, max_restarts=1,
                                         skip_errors=False, on_restart=restarts.append))


def chunk(c: int) -> Chunk:
    return Chunk(0, [c * BATCH + n for n in range(BATCH)], [b""] * BATCH)


async def test_pool_decoder_queues_at_most_per_process_chunks_at_each_process() -> None:
    pool, restarts = FakePool(2), list[str]()
    decoder = pool_decoder(pool, restarts)
    decodes = [asyncio.create_task(decoder.decode(chunk(c))) for c in range(8)]
    answered = 0
    try:
        while answered < len(decodes):
            await until(lambda: any(p.queue for p in pool.processes))
            await settle()
            for process in pool.processes:
                assert len(process.queue) <= PER_PROCESS
                if process.queue:
                    process.answer()
                    answered += 1
        results = [(await asyncio.wait_for(d, WAIT)).items[0] for d in decodes]
        assert results == [tuple(chunk(c).indices) for c in range(8)]
        assert all(p.most_queued == PER_PROCESS for p in pool.processes)
    finally:
        await asyncio.wait_for(decoder.aclose(), WAIT)
    assert pool.closed  # it owned the pool


async def test_pool_decoder_sends_a_dead_processs_chunks_again_in_order() -> None:
    pool, restarts = FakePool(1), list[str]()
    decoder = pool_decoder(pool, restarts)
    decodes = [asyncio.create_task(decoder.decode(chunk(c))) for c in range(2)]
    try:
        await until(lambda: len(pool.processes[0].queue) == 2)
        dead = pool.processes[0]
        dead.die()
        await until(lambda: pool.processes[0] is not dead and len(pool.processes[0].queue) == 2)
        assert [t.chunk.indices for t in pool.processes[0].queue] == [
            t.chunk.indices for t in dead.queue]
        assert restarts and "fake process 0 ended abruptly (killed by SIGKILL)" in restarts[0]
        pool.processes[0].answer()
        pool.processes[0].answer()
        results = [(await asyncio.wait_for(d, WAIT)).items[0] for d in decodes]
        assert results == [tuple(chunk(c).indices) for c in range(2)]
    finally:
        await asyncio.wait_for(decoder.aclose(), WAIT)


async def test_pool_decoder_past_max_restarts_fails_naming_the_samples() -> None:
    pool, restarts = FakePool(1), list[str]()
    decoder = pool_decoder(pool, restarts)
    decode = asyncio.create_task(decoder.decode(chunk(3)))
    try:
        first = pool.processes[0]
        await until(lambda: len(first.queue) == 1)
        first.die()
        await until(lambda: pool.processes[0] is not first and len(pool.processes[0].queue) == 1)
        pool.processes[0].die()  # max_restarts=1: the second death is one too many
        with pytest.raises(WorkerDiedError, match=r"samples \[6, 7\]"):
            await asyncio.wait_for(decode, WAIT)
    finally:
        await asyncio.wait_for(decoder.aclose(), WAIT)


async def test_pool_decoder_aclose_retires_the_processes_still_holding_its_chunks() -> None:
    pool, restarts = FakePool(2), list[str]()
    decoder = pool_decoder(pool, restarts)
    decode = asyncio.create_task(decoder.decode(chunk(0)))
    await until(lambda: any(p.queue for p in pool.processes))
    busy = next(p for p in pool.processes if p.queue)
    idle = next(p for p in pool.processes if not p.queue)
    await asyncio.wait_for(decoder.aclose(), WAIT)
    assert busy.retired and not idle.retired
    assert pool.listener is None
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(decode, WAIT)


def test_parts_of_a_chunk_join_with_skips_at_their_places_and_the_first_failure() -> None:
    first = ChunkResult([np.arange(2)], [(1, "ValueError: bad")], durations=[0.1, 0.1])
    second = ChunkResult([np.arange(2, 5)], [(0, "OSError: gone")])
    joined = join_results([first, second], [3, 4])
    assert joined.items[0].tolist() == [0, 1, 2, 3, 4]
    assert joined.skipped == [(1, "ValueError: bad"), (3, "OSError: gone")]
    failing = [ChunkResult([], [], failure=(9, "KeyError: 9", "tb")),
               ChunkResult([], [], failure=(2, "KeyError: 2", "tb"))]
    assert join_results([first, *failing], [3, 1, 1]).failure == (9, "KeyError: 9", "tb")
