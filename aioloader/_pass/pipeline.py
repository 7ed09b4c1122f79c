"""A pass: one iteration over (the rest of) an epoch, in one event loop.

A pass owns everything it starts: its storage (connection pools), its read and decode tasks, its
hold on the decode pool (the pool itself when workers are not persistent) and the shared blocks
lent to its chunks. It releases all of it on every exit path (the end, a `break`, an error, the
loader closing) in the loop that runs it, or, when it was dropped without being closed, at once
and without waiting.

Inside, the stages have one job each: the source reads raw items ahead (bounded by the memory
limit and the read-ahead, not by batches), the decode stage sends complete chunks to the decoder
(at most `decode_window` chunks decoding or finished and not yet taken), the hand-over gives the
consumer finished batches in order, and a watchdog fails the pass if nothing moves for
`stall_timeout` seconds while something is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from .._errors import LoaderError, RemoteTraceback, SampleError, StallError, named_type, typed
from .._ipc import shm, transport
from .._ipc.messages import Chunk, ChunkResult, Layout
from .._ipc.shared_bytes import shared_nbytes
from .._ipc.transport import BlockPool, Slot
from .._scheduling.decoders import Decoder
from .._stats import LoaderStats, now
from .._tasks import TaskSet
from .._worker.decode import join_results, join_rows
from ..storage._storage import Storage
from .budget import MemoryBudget
from .feeds import SKIPPED, Pending, estimate_bytes, fetch_failure
from .handover import EMPTY, Failed, Finished, Handover

T = TypeVar("T")

END = object()
"""What `Pass.next` returns after the last batch."""


@dataclass(frozen=True)
class PassConfig:
    """The loader's settings as the pass started: later changes do not reach a running pass."""

    epoch: int
    batch_size: int | None
    steps_per_chunk: int
    ordered: bool
    skip_errors: bool
    memory_limit: int
    read_ahead: int
    """Samples read or being read ahead of the decode stage, at most."""
    decode_window: int
    """Chunks decoding or finished and not yet taken, at most."""
    stall_timeout: float
    first_chunk_parts: int = 1
    """Decode processes the pass's first chunk is divided among (its batch comes that many
    times sooner); 1: not divided (a collate of the user's own cannot be joined)."""
    start_chunks: int = 2
    """Chunks read ahead until the first is decoded: the first, and one for each decode
    process to go on with."""
    row_by_row: bool = True
    """A decode process writes each sample into its row of the block as it comes (the default
    collate): it holds one decoded sample at a time, not the chunk's."""


class Source(Protocol):
    async def feed(self, work: Any) -> None: ...

    def position(self, steps_done: int) -> int: ...

    def copies(self, steps_done: int) -> dict[str, Any] | None: ...

    def key(self, pending: Pending, position: int) -> str: ...

    def oldest_read(self) -> tuple[float, str] | None: ...


class Pass:
    def __init__(
        self,
        config: PassConfig,
        source: Source,
        decoder: Decoder,
        blocks: BlockPool | None,
        stats: LoaderStats,
        storage: Storage,
        run_in_context: Callable[[Callable[[], asyncio.Task[None]]], asyncio.Task[None]],
        side_tasks: list[Coroutine[Any, Any, None]] | None = None,
        owns_storage: bool = True,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.config = config
        self._source = source
        self._decoder = decoder
        self._blocks = blocks
        self._budget = budget or MemoryBudget(config.memory_limit, blocks)
        """The memory limit's account, shared with the blocks (and a node's other ranks)."""
        self._stats = stats
        self._storage = storage
        self._run_in_context = run_in_context
        self._side_tasks = side_tasks or []
        self._owns_storage = owns_storage
        """False when the storage serves other passes too (a node's ranks): it stays open."""
        self.loop = asyncio.get_running_loop()
        """The loop the pass runs in: its tasks and storage belong to it."""
        self._handover = Handover(config.ordered)
        self._ready: list[tuple[int, int, Pending]] = []
        """Chunks whose raws are all in, by first step (a heap)."""
        self._stage_changed = asyncio.Event()
        """Set when the decode stage may have something to do."""
        self._room_changed = asyncio.Event()
        """Set when the source may have room to read more."""
        self._holding = 0
        """Stages waiting for room under the memory limit now (`_held_back`)."""
        self._held_since = 0.0
        self._fed = False
        self._feed_error: BaseException | None = None
        self._next_step = 0
        self._raw = 0
        """Bytes of raw items read and not decoded yet."""
        self._results = 0
        """Bytes of decoded batches not taken by the consumer yet, held in this heap (those
        in shared blocks are the pool's to count)."""
        self._reserved = 0
        """Bytes promised to the chunks being decoded (`Pending.reserved`)."""
        self.blocks_promised = 0
        """Of those, the blocks of chunks not lent one yet."""
        self._urgent = False
        """The consumer waits for the next batch: its chunk may decode past the limit."""
        self._ahead = 0
        self._samples_per_step = config.batch_size or 1
        self._raw_per_sample = 0.0
        """A moving average of a raw item's bytes (a decoded sample's is the account's)."""
        self._decoding = 0
        self._decoded_any = False
        self._parts = config.first_chunk_parts
        """What the next chunk to decode is divided into: the first one only."""
        self._lent: set[str] = set()
        self._tasks = TaskSet()
        self._progress_at = now()
        self._started = now()
        self._busy_before = stats.busy_seconds
        self._handed_over_at: float | None = None
        self._delivered_samples = 0
        self._skipped_before = stats.skipped
        self.steps_done = 0
        self.finished = False
        self.closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._budget.join(self)
        loop = self.loop

        def in_loop(call: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(call)

        self._budget.on_block_released(in_loop)
        self._run_in_context(lambda: self._spawn(self._feed(), "feed"))
        self._spawn(self._decode_stage(), "decode")
        self._spawn(self._watch(), "watchdog")
        for side in self._side_tasks:
            self._spawn(side, "side")

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._tasks.start(coroutine, f"aioloader-{name}")

    def fail(self, error: BaseException) -> None:
        """Make the consumer's next wait raise `error`; the pass is then closed by its owner."""
        self._handover.fail(error)

    def abandon(self) -> None:
        """The pass was dropped without being closed (a `break` in `async for`): release at
        once, without awaiting: stop the tasks, let go of the decode processes."""
        if self.closed:
            return
        self.closed = True
        self._handover.fail(LoaderError("this pass was abandoned"))
        self._tasks.cancel_all()
        self._decoder.abandon()
        self._budget.leave(self)
        if self._blocks is not None:
            for name in self._lent:
                self._blocks.retire(name)
        if self._owns_storage:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the session goes too
                self.loop.create_task(self._storage.aclose())

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._handover.fail(LoaderError("this pass was closed"))
        try:
            await asyncio.gather(*self._tasks.cancel_all(), return_exceptions=True)
            await self._decoder.aclose()  # busy processes are stopped: blocks are safe to drop
            if self._blocks is not None:
                for name in self._lent:
                    self._blocks.retire(name)
        finally:
            self._budget.leave(self)
            if self._owns_storage:
                await self._storage.aclose()

    @property
    def position(self) -> int:
        return self._source.position(self.steps_done)

    @property
    def copies(self) -> dict[str, Any] | None:
        """An IterableDataset's: where each worker's copy stands (`IterableSource`)."""
        return self._source.copies(self.steps_done)

    @property
    def goes_on(self) -> bool:
        """After the error `next` raised: the next `next` gives the following batch (the error
        was one step's), rather than the pass having ended or failed as a whole."""
        return not (self.closed or self.finished or self._handover.failed)

    # -- the consumer's side ----------------------------------------------------------------------

    async def next(self, waits: bool = True) -> Any:
        """The next batch, or END; raises the first failure in step order. `waits`: the
        consumer waits for it (a service asking ahead of its client does not: `hurry` says
        when the client does)."""
        stats = self._stats
        asked = now()
        if self._handed_over_at is not None:
            stats.event("consumer", self._handed_over_at, asked, "step")
            stats.consumer_work.add(asked - self._handed_over_at)
        while True:
            if waits:
                self.hurry()
            try:
                finished = await self._handover.take()
            finally:
                self._urgent = False
            self._progress_at = got = now()
            if finished is None:
                self.finished = True
                self._check_not_all_skipped()
                return END
            self._results -= finished.held
            self._budget.freed()
            self.steps_done = self._handover.steps_done(finished.step)
            stats.queue_wait.add(got - finished.at)
            stats.busy_seconds = self._busy_before + got - self._started
            if isinstance(finished.item, Failed):
                raise finished.item.error
            if finished.item is not EMPTY:
                stats.batches += 1
                stats.consumer_wait.add(got - asked)
                stats.event("consumer", asked, got, "wait")
                self._handed_over_at = got
                return finished.item

    def hurry(self) -> None:
        """The consumer waits: the chunk it needs next may decode past the memory limit."""
        self._urgent = True
        self._stage_changed.set()

    @property
    def held_here(self) -> int:
        """What the memory limit counts here, besides the blocks: raw items, batches in this
        heap, and what the chunks being decoded were promised."""
        return self._raw + self._results + self._reserved

    @property
    def decoding(self) -> int:
        return self._decoding

    @property
    def starving(self) -> bool:
        return self._urgent and not self._decoding

    def wake(self) -> None:
        self._room_changed.set()
        self._stage_changed.set()

    def _check_not_all_skipped(self) -> None:
        if self._delivered_samples == 0 and self._skipped_here:
            reasons = "; ".join(list(self._stats.skip_reasons)[:3])
            raise LoaderError(
                f"every sample of this pass failed ({self._skipped_here} skipped with "
                f'on_error="skip"); first reasons: {reasons}'
            )

    @property
    def _skipped_here(self) -> int:
        return self._stats.skipped - self._skipped_before

    # -- what the source sees (the Work protocol) ------------------------------------------------

    def has_room(self) -> bool:
        config = self.config
        return not self._ahead or (
            self._committed() < config.memory_limit and self._ahead < self._read_ahead())

    def _read_ahead(self) -> int:
        """Samples read ahead, at most: until the first chunk is decoded, `start_chunks`
        worth, so that reads (theirs and a local server's CPU) do not take the cores from the
        first batch's decode; then `read_ahead`."""
        if self._decoded_any:
            return self.config.read_ahead
        chunk = self.config.steps_per_chunk * self._samples_per_step
        return min(self.config.read_ahead, self.config.start_chunks * chunk)

    async def room(self) -> None:
        while not self.has_room():
            self._room_changed.clear()
            with self._held_back(self._committed() >= self.config.memory_limit):
                await self._room_changed.wait()

    @contextlib.contextmanager
    def _held_back(self, by_memory: bool) -> Iterator[None]:
        """Count the wall time while reading or decoding (either) waits for room under the
        memory limit (`stats.memory_wait`)."""
        if not by_memory:
            yield
            return
        if not self._holding:
            self._held_since = now()
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding:
                self._stats.memory_wait += now() - self._held_since

    def _committed(self) -> int:
        """What reading more would commit the loader to: raw bytes held, and everything else
        the memory limit counts (batches in blocks or in a heap, decodes under way, a node's
        other ranks), or the results decoding may hold at once if more (a full decode window
        at the average result size so far; before any, the raw size). Samples still being read
        count at the average raw size. Reads stop before the limit, not a window of results
        after it; with nothing read ahead, a chunk may always be read."""
        if not self._raw_per_sample:
            return self.config.memory_limit  # nothing arrived yet: one chunk at a time
        per_sample = self._budget.sample_bytes or self._raw_per_sample
        window = self.config.decode_window * self.config.steps_per_chunk * self._samples_per_step
        raw = max(self._raw, int(self._ahead * self._raw_per_sample))  # reads in flight too
        return raw + max(self._budget.held() - self._raw, int(window * per_sample))

    def reading(self, pending: Pending, count: int) -> None:
        pending.ahead += count
        self._ahead += count

    def hold(self, pending: Pending, raw: Any, weight: int = 1) -> None:
        size = estimate_bytes(raw)
        self._stats.shared_bytes += shared_nbytes(raw)
        self._count_raw(pending, size * weight, size, 64)

    def hold_all(self, pending: Pending, raws: list[Any]) -> None:
        if raws:
            size = sum(map(estimate_bytes, raws))
            self._stats.shared_bytes += sum(map(shared_nbytes, raws))
            self._count_raw(pending, size, size / len(raws), 1)

    def _count_raw(self, pending: Pending, size: int, per_sample: float, weight: int) -> None:
        pending.held += size
        self._raw += size
        if not self._raw_per_sample:  # the first size known: reading ahead may go on now
            self._room_changed.set()
        self._raw_per_sample = _averaged(self._raw_per_sample, max(per_sample, 1.0), weight)
        self._progress_at = now()

    def complete(self, pending: Pending) -> None:
        heapq.heappush(self._ready, (pending.first_step, id(pending), pending))
        self._stage_changed.set()

    def drop(self, pending: Pending) -> None:
        self._release(pending)

    def _release(self, pending: Pending) -> None:
        self._raw -= pending.held
        self._ahead -= pending.ahead
        self._room_changed.set()
        self._stage_changed.set()

    async def _feed(self) -> None:
        try:
            await self._source.feed(self)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._feed_error = e
        finally:
            self._fed = True
            self._stage_changed.set()

    # -- decoding -------------------------------------------------------------------------------

    async def _decode_stage(self) -> None:
        decoding = TaskSet()
        while True:
            while not self._fed and not self._may_decode():
                self._stage_changed.clear()
                with self._held_back(self._short_of_room()):
                    await self._stage_changed.wait()
            if not self._ready:
                break
            if not self._may_decode():  # everything is fed: wait for the window only
                self._stage_changed.clear()
                with self._held_back(self._short_of_room()):
                    await self._stage_changed.wait()
                continue
            pending = heapq.heappop(self._ready)[2]
            pending.reserved = self._chunk_cost()
            pending.block = self._batch_bytes()
            self._reserved += pending.reserved
            self.blocks_promised += pending.block
            self._decoding += 1
            self._budget.wake_others(self)  # none starves on this pass now
            self._next_step = max(self._next_step, pending.first_step + pending.steps)
            decoding.add(self._spawn(self._decode(pending), "chunk"))
        if decoding:
            await asyncio.wait(decoding)
        if self._feed_error is not None:
            self._handover.put(Finished(self._next_step, Failed(self._feed_error), 0, now()))
        self._handover.finish()

    def _short_of_room(self) -> bool:
        """A chunk is ready to decode, and what it will hold does not fit in the room."""
        return bool(self._ready) and self._chunk_cost() > self._budget.room()

    def _may_decode(self) -> bool:
        """Whether the first ready chunk may start decoding. In order, the window is a distance
        ahead of the next step to hand over; out of order, it is a count of chunks decoding or
        finished. Within it, a chunk decodes if what it will hold fits in the memory limit's
        room, or if the consumer waits for it, whatever the room, once no other pass of the
        account is decoding; one the consumer does not wait for yet waits while another pass's
        consumer starves. Until a chunk has been decoded, what one holds is not known: one
        chunk at a time in the whole account, to learn it."""
        if not self._ready:
            return False
        window = self.config.decode_window
        if self.config.ordered:
            first_step = self._ready[0][0]
            needed_next = first_step == self._handover.next_step
            if first_step >= self._handover.next_step + window * self.config.steps_per_chunk:
                return False
        else:
            waiting_chunks = -(-self._handover.waiting // self.config.steps_per_chunk)
            if self._decoding + waiting_chunks >= window:
                return False
            needed_next = self._decoding == 0 and waiting_chunks == 0
        alone = not self._budget.others_decoding(self)
        if self._budget.sample_bytes is None:
            return self._decoding == 0 and alone
        if needed_next and self._urgent:
            return alone or self._chunk_cost() <= self._budget.room()
        return (self._chunk_cost() <= self._budget.room()
                and not self._budget.others_starving(self))

    def _chunk_cost(self) -> int:
        """What decoding a chunk may come to hold: its batch, and the decoded samples on the
        way into it (one at a time when written row by row, else the chunk's)."""
        samples = self.config.steps_per_chunk * self._samples_per_step
        row_by_row = self.config.row_by_row and self._blocks is not None
        return self._batch_bytes() + int((self._budget.sample_bytes or 0.0) * (
            1 if row_by_row else samples))

    def _batch_bytes(self) -> int:
        return int((self._budget.sample_bytes or 0.0)
                   * self.config.steps_per_chunk * self._samples_per_step)

    async def _decode(self, pending: Pending) -> None:
        try:
            outcome, held, in_heap = await self._decode_chunk(pending)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            outcome, held, in_heap = Failed(e), 0, 0
        finally:
            self._decoding -= 1
            self._decoded_any = True
            self._reserved -= pending.reserved
            self.blocks_promised -= pending.block
            pending.reserved = pending.block = 0
            self._release(pending)
            self._budget.wake_others(self)  # their room, and their turn past the limit
        self._progress_at = moment = now()
        self._results += in_heap
        if pending.indices:
            per_sample = held / len(pending.indices)
            self._budget.sample_bytes = _averaged(self._budget.sample_bytes or 0.0, per_sample, 8)
        if isinstance(outcome, Failed):  # its other steps are lost with it, and counted done
            self._handover.put(Finished(pending.first_step, outcome, in_heap, moment))
            for step in range(pending.first_step + 1, pending.first_step + pending.steps):
                self._handover.put(Finished(step, EMPTY, 0, moment))
            return
        share = in_heap // max(len(outcome), 1)
        for n, item in enumerate(outcome):
            last = n == len(outcome) - 1
            part = in_heap - share * (len(outcome) - 1) if last else share
            self._handover.put(Finished(pending.first_step + n, item, part, moment))

    async def _decode_chunk(self, pending: Pending) -> tuple[list[Any] | Failed, int, int]:
        """The chunk's items, one per step (EMPTY where everything was skipped), the bytes
        they hold and those of them in this heap (not in a shared block); or the chunk's
        failure."""
        if pending.failure is not None:
            return Failed(pending.failure), 0, 0
        kept = [n for n, raw in enumerate(pending.raws) if raw is not SKIPPED]
        parts, self._parts = min(self._parts, len(kept)), 1
        result, held = await (self._decode_divided(pending, kept, parts)
                              if parts > 1 and self._blocks is not None
                              else self._decode_part(pending, kept))
        in_heap = 0 if result.shared else held
        if pending.on_result is not None:
            pending.on_result(result)
        failure = self._failure_of(pending, kept, result)
        if failure is not None:
            return Failed(failure), held, in_heap
        self._delivered_samples += len(kept) - len(result.skipped)
        if self.config.batch_size:
            return [result.items[0] if result.items else EMPTY], held, in_heap
        decoded = iter(result.items)
        skipped = {kept[position] for position, _ in result.skipped}
        skipped.update(n for n, raw in enumerate(pending.raws) if raw is SKIPPED)
        return ([EMPTY if n in skipped else next(decoded, EMPTY) for n in range(pending.steps)],
                held, in_heap)  # (fewer items: an IterableDataset's worker ran out)

    async def _decode_part(self, pending: Pending, positions: list[int], here: bool = False
                           ) -> tuple[ChunkResult, int]:
        """Decode the samples of `pending` at `positions`; the result and the bytes it holds.
        `here`: the result is a part, to be joined in this process, in a block of its own
        (sized for a part, it is removed once joined, never lent again)."""
        def lend(chunk: Chunk) -> None:
            if chunk.slot is None and self._blocks is not None:  # once, if sent again
                chunk.slot = self._blocks.lease(once=here)
                if chunk.slot is not None:
                    self._lent.add(chunk.slot.name)
                    # a block used again: the pool counts it now, no more the promise
                    reused = min(chunk.slot.size, pending.reserved)
                    pending.reserved -= reused
                    self._reserved -= reused
                self.blocks_promised -= pending.block
                pending.block = 0

        chunk = self._chunk_of(pending, positions, None)
        if self._decoder.lends_late:
            chunk.on_send = lend
        else:
            lend(chunk)
        result = await self._run(chunk)
        return result, self._receive(result, chunk.slot, here)

    async def _decode_divided(self, pending: Pending, kept: list[int], parts: int
                              ) -> tuple[ChunkResult, int]:
        """A pass's first chunk, decoded by `parts` processes at once: its batch comes about
        `parts` times sooner. Its first sample goes first, into a block with a row for every
        sample of the chunk; what a decoded sample holds and where its arrays lie are then
        known, and the rest is divided among as many processes as the memory limit has room
        for a decoded sample on the way, each writing its rows into that block in place: the
        batch is never copied, and never held twice. Where the first sample leaves no block
        (small batches, a skipped sample, shared memory full), the rest is divided all the same,
        each part in a block of its own, joined by a copy."""
        assert self._blocks is not None
        slot = self._blocks.lease()
        if slot is not None:
            self._lent.add(slot.name)
        first = await self._run(self._chunk_of(pending, kept[:1], slot, rows=len(kept)))
        rest = kept[1:]
        if slot is None or not first.shared or first.layout is None:
            self._receive(first, slot, here=True)
            return await self._decode_copied(pending, first, rest, parts)
        self._budget.sample_bytes = sample = first.needed / len(kept)
        self._reserved += first.needed  # the block, not the pool's to count until adopted
        try:
            room = max(0, self._budget.room())
            parts = max(1, min(parts, len(rest), int(room // sample) if sample else parts))
            pieces = _divided(rest, parts)
            lent = transport.Slot(slot.name, first.needed)
            chunks = [self._chunk_of(pending, piece, lent, rows=len(kept),
                                     first_row=1 + len(pieces[0]) * n, layout=first.layout)
                      for n, piece in enumerate(pieces)]
            results = await _every(map(self._run, chunks))  # they share a block
        finally:
            self._reserved -= first.needed
        memory = np.frombuffer(shm.attach_block(slot.name), np.uint8)
        joined = join_rows([first, *results], [1, *map(len, pieces)], memory)
        del memory
        joined.needed, joined.shared = first.needed, joined.failure is None and bool(joined.items)
        if not joined.shared:
            self._lent.discard(slot.name)
            self._blocks.retire(slot.name)
            return joined, 0
        return joined, self._receive(joined, slot)

    async def _decode_copied(self, pending: Pending, first: ChunkResult, rest: list[int],
                             parts: int) -> tuple[ChunkResult, int]:
        """The rest of a first chunk in `parts` parts, each in a block of its own, joined here
        with the first sample's result, then put in a shared block as a decode process would."""
        pieces = _divided(rest, parts) if rest else []
        parts_decoded = await _every(self._decode_part(pending, piece, here=True)
                                     for piece in pieces)
        decoded = [first, *(result for result, _ in parts_decoded)]
        sizes = [1, *map(len, pieces)]
        # the parts' bytes: at least what the joined arrays need
        needed = sum(transport.shared_bytes(part.items) for part in decoded)
        slot = (self._blocks.lease() if self._blocks is not None
                and needed >= transport.SMALL_RESULT else None)
        allocate, no_space = None, False
        if slot is not None:
            self._lent.add(slot.name)
            try:
                allocate = transport.allocator(slot, needed)
            except transport.NoSpace:
                no_space = True
        joined = join_results(decoded, sizes, allocate)
        joined.no_space = no_space
        if allocate is not None and allocate.used and joined.failure is None:
            joined.items = allocate.places(joined.items)  # joined straight into the block
            joined.needed, joined.shared = allocate.used, True
        else:
            joined.needed = transport.shared_bytes(joined.items)
            if allocate is not None and self._blocks is not None and slot is not None:
                self._lent.discard(slot.name)
                self._blocks.retire(slot.name)  # made for this batch, which went elsewhere
                slot = None
        return joined, self._receive(joined, slot)

    def _chunk_of(self, pending: Pending, positions: list[int], slot: Slot | None, rows: int = 0,
                  first_row: int = 0, layout: Layout | None = None) -> Chunk:
        return Chunk(self.config.epoch, [pending.indices[n] for n in positions],
                     [pending.raws[n] for n in positions], slot, pending.first_step, rows=rows,
                     first_row=first_row, layout=layout, worker=pending.worker)

    async def _run(self, chunk: Chunk) -> ChunkResult:
        """Decode a chunk already lent its block (if any); a block of a chunk that failed is
        removed once its process can no longer write it."""
        try:
            result = await self._decoder.decode(chunk)
        except asyncio.CancelledError:
            raise
        except BaseException:
            if chunk.slot is not None and self._blocks is not None:
                self._lent.discard(chunk.slot.name)
                self._blocks.retire(chunk.slot.name)  # its process may have been mid-write
            raise
        self._record(result)
        return result

    def _receive(self, result: ChunkResult, slot: Slot | None, here: bool = False) -> int:
        """Map a result's arrays out of its shared block, or give the unused block back; the
        bytes the result holds. `here`: a part of a batch, mapped in this process to be joined
        (counted with the batch)."""
        blocks, counts = self._blocks, self._stats.transport
        if blocks is not None and slot is not None:
            self._lent.discard(slot.name)
            if result.shared:
                result.items = blocks.adopt(result.items, slot, here)
                counts["shared"] += not here
                return result.needed
            if result.no_space:
                self._warn_no_space(result.needed)
            if result.needed > slot.size > 0:
                blocks.retire(slot.name)  # too small for these batches: a fresh one next time
            else:
                blocks.release(slot.name)
        if result.items and result.needed and not here:
            counts["pickled"] += 1
        return result.needed

    def _warn_no_space(self, needed: int) -> None:
        self._stats.transport["no_space"] = self._stats.transport.get("no_space", 0) + 1
        if self._stats.transport["no_space"] == 1:
            warnings.warn(
                f"shared memory has no room for a batch of {needed / 2**20:.1f} MiB (the "
                "memory this job may use is spent), so batches come back pickled (slower). "
                "Lower memory_limit or prefetch, or raise the job's memory limit.",
                RuntimeWarning,
                stacklevel=2,
            )

    def _record(self, result: ChunkResult) -> None:
        self._stats.decode.extend(result.durations)
        self._stats.bytes_to_decode += result.received
        if result.span is not None:
            self._stats.event(result.process, *result.span, "decode")

    def _failure_of(
        self, pending: Pending, kept: list[int], result: ChunkResult
    ) -> BaseException | None:
        stats = self._stats

        def sample_error(index: int, position: int, reason: str,
                         original: type[Exception] | None) -> SampleError:
            """A sample's failure in decode, or in its read there (as a read's failure)."""
            key = self._source.key(pending, position)
            read_error = result.read_errors.get(index)
            if read_error is not None:
                return fetch_failure(index, key, read_error)
            return typed(SampleError, original)(index, key, "decode", reason)

        for position, reason in result.skipped:
            skipped = pending.indices[kept[position]]
            stats.record_skip(str(sample_error(skipped, kept[position], reason, None)))
        if result.failure is None:
            stats.samples += len(kept) - len(result.skipped)
            return None
        index, reason, text, kind = result.failure
        original = named_type(kind)
        if index is None:
            error: LoaderError = typed(LoaderError, original)(
                f"collate failed for samples {pending.indices[:8]}: {reason}")
        else:
            error = sample_error(index, pending.indices.index(index), reason, original)
        error.__cause__ = RemoteTraceback(text)
        return error

    # -- the watchdog ---------------------------------------------------------------------------

    async def _watch(self) -> None:
        timeout = self.config.stall_timeout
        while True:
            await asyncio.sleep(min(max(timeout / 4, 0.05), 5.0))
            idle = now() - self._progress_at
            if idle < timeout:
                continue
            holder = self._holder()
            if holder is not None:
                self.fail(StallError(
                    f"nothing was read, decoded or handed over for {idle:.0f} s "
                    f"(stall_timeout={timeout:g}); {holder}"
                ))
                return

    def _holder(self) -> str | None:
        """What the pass waits on: the oldest read or decode in flight; None if nothing is."""
        candidates = list(self._decoder.in_flight())
        read = self._source.oldest_read()
        if read is not None:
            candidates.append(read)
        if not candidates:
            return None
        seconds, what = max(candidates)
        return f"{what} has been in flight for {seconds:.0f} s"


def _divided(positions: list[int], parts: int) -> list[list[int]]:
    """`positions` in at most `parts` consecutive pieces of one size (the last shorter)."""
    size = -(-len(positions) // parts)
    return [positions[start:start + size] for start in range(0, len(positions), size)]


async def _every(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Their results, in order; each ends before this returns, even when one fails (the
    parts of a chunk: then the first failure is raised)."""
    outcomes = await asyncio.gather(*awaitables, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return cast(list[T], outcomes)


def _averaged(average: float, value: float, weight: int) -> float:
    """A moving average over about `weight` values, starting at the first one."""
    return value if average == 0 else average + (value - average) / weight
