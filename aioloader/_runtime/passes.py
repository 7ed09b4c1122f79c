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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol, cast

from .._errors import LoaderError, RemoteTraceback, SampleError, StallError
from .._stats import LoaderStats, now
from ..storage._storage import Storage
from . import transport
from .decode import join_results
from .decoders import Decoder
from .handover import EMPTY, Failed, Finished, Handover
from .messages import Chunk, ChunkResult
from .sources import SKIPPED, Pending, estimate_bytes
from .tasks import TaskSet
from .transport import BlockPool, Slot

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


class Source(Protocol):
    async def feed(self, work: Any) -> None: ...

    def position(self, steps_done: int) -> int: ...

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
    ) -> None:
        self.config = config
        self._source = source
        self._decoder = decoder
        self._blocks = blocks
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
        self._fed = False
        self._feed_error: BaseException | None = None
        self._next_step = 0
        self._raw = 0
        """Bytes of raw items read and not decoded yet."""
        self._results = 0
        """Bytes of decoded batches not taken by the consumer yet."""
        self._ahead = 0
        self._samples_per_step = config.batch_size or 1
        self._raw_per_sample = 0.0
        self._result_per_sample = 0.0
        """Moving averages of a sample's bytes, raw and decoded."""
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
        if self._blocks is not None:
            for name in self._lent:
                self._blocks.retire_later(name)
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
                retire = (self._blocks.retire_later if self._decoder.shared
                          else self._blocks.retire)  # shared: a process may write it yet
                for name in self._lent:
                    retire(name)
        finally:
            if self._owns_storage:
                await self._storage.aclose()

    @property
    def position(self) -> int:
        return self._source.position(self.steps_done)

    # -- the consumer's side ----------------------------------------------------------------------

    async def next(self) -> Any:
        """The next batch, or END; raises the first failure in step order."""
        stats = self._stats
        asked = now()
        if self._handed_over_at is not None:
            stats.event("consumer", self._handed_over_at, asked, "step")
        while True:
            finished = await self._handover.take()
            self._progress_at = got = now()
            if finished is None:
                self.finished = True
                self._check_not_all_skipped()
                return END
            self._results -= finished.held
            if self._blocks is not None and not self._decoder.shared:
                # idle blocks only in the room samples leave (a node's pool is bounded as one)
                self._blocks.keep_idle(max(0, self.config.memory_limit - self._held))
            self._room_changed.set()
            self._stage_changed.set()
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
            await self._room_changed.wait()

    @property
    def _held(self) -> int:
        return self._raw + self._results

    def _committed(self) -> int:
        """What reading more would commit the loader to: raw bytes held, the idle shared
        blocks kept for reuse, and the results decoding may hold at once (a full decode window
        at the average result size so far; before any, the raw size), or the results held if
        more. Samples still being read count at the average raw size. Reads stop before the
        limit, not a window of results after it; with nothing read ahead, a chunk may always be
        read."""
        if not self._raw_per_sample:
            return self.config.memory_limit  # nothing arrived yet: one chunk at a time
        per_sample = self._result_per_sample or self._raw_per_sample
        window = self.config.decode_window * self.config.steps_per_chunk * self._samples_per_step
        idle = (self._blocks.idle_bytes
                if self._blocks is not None and not self._decoder.shared else 0)
        raw = max(self._raw, int(self._ahead * self._raw_per_sample))  # reads in flight too
        return raw + idle + max(self._results, int(window * per_sample))

    def reading(self, pending: Pending, count: int) -> None:
        pending.ahead += count
        self._ahead += count

    def hold(self, pending: Pending, raw: Any, weight: int = 1) -> None:
        size = estimate_bytes(raw)
        self._count_raw(pending, size * weight, size, 64)

    def hold_all(self, pending: Pending, raws: list[Any]) -> None:
        if raws:
            size = sum(map(estimate_bytes, raws))
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
                await self._stage_changed.wait()
            if not self._ready:
                break
            if not self._may_decode():  # everything is fed: wait for the window only
                self._stage_changed.clear()
                await self._stage_changed.wait()
                continue
            pending = heapq.heappop(self._ready)[2]
            self._decoding += 1
            self._next_step = max(self._next_step, pending.first_step + pending.steps)
            decoding.add(self._spawn(self._decode(pending), "chunk"))
        if decoding:
            await asyncio.wait(decoding)
        if self._feed_error is not None:
            self._handover.put(Finished(self._next_step, Failed(self._feed_error), 0, now()))
        self._handover.finish()

    def _may_decode(self) -> bool:
        """Whether the first ready chunk may start decoding. In order, the window is a distance
        ahead of the next step to hand over, so the chunk the consumer waits for always may;
        out of order, it is a count of chunks decoding or finished. Over the memory limit, only
        the chunk the consumer needs next."""
        if not self._ready:
            return False
        window = self.config.decode_window
        per_chunk = (self._result_per_sample or self._raw_per_sample) * (
            self.config.steps_per_chunk * self._samples_per_step)
        # results held, and those the chunks being decoded will bring
        over = self._held + self._decoding * per_chunk >= self.config.memory_limit
        if self.config.ordered:
            first_step = self._ready[0][0]
            if first_step == self._handover.next_step:
                return True  # what the consumer waits for, whatever the budget
            return not over and (
                first_step < self._handover.next_step + window * self.config.steps_per_chunk)
        waiting_chunks = -(-self._handover.waiting // self.config.steps_per_chunk)
        if over:
            return self._decoding == 0 and waiting_chunks == 0
        return self._decoding + waiting_chunks < window

    async def _decode(self, pending: Pending) -> None:
        try:
            outcome, held = await self._decode_chunk(pending)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            outcome, held = Failed(e), 0
        finally:
            self._decoding -= 1
            self._decoded_any = True
            self._release(pending)
        self._progress_at = moment = now()
        self._results += held
        if pending.indices:
            per_sample = held / len(pending.indices)
            self._result_per_sample = _averaged(self._result_per_sample, per_sample, 8)
        if isinstance(outcome, Failed):
            self._handover.put(Finished(pending.first_step, outcome, held, moment))
            return
        share = held // max(len(outcome), 1)
        for n, item in enumerate(outcome):
            last = n == len(outcome) - 1
            part = held - share * (len(outcome) - 1) if last else share
            self._handover.put(Finished(pending.first_step + n, item, part, moment))

    async def _decode_chunk(self, pending: Pending) -> tuple[list[Any] | Failed, int]:
        """The chunk's items, one per step (EMPTY where everything was skipped), and the bytes
        they hold; or the chunk's failure."""
        if pending.failure is not None:
            return Failed(pending.failure), 0
        kept = [n for n, raw in enumerate(pending.raws) if raw is not SKIPPED]
        parts, self._parts = min(self._parts, len(kept)), 1
        result, held = await (self._decode_divided(pending, kept, parts)
                              if parts > 1 and self._blocks is not None
                              else self._decode_part(pending, kept))
        failure = self._failure_of(pending, kept, result)
        if failure is not None:
            return Failed(failure), held
        self._delivered_samples += len(kept) - len(result.skipped)
        if self.config.batch_size:
            return [result.items[0] if result.items else EMPTY], held
        decoded = iter(result.items)
        skipped = {kept[position] for position, _ in result.skipped}
        skipped.update(n for n, raw in enumerate(pending.raws) if raw is SKIPPED)
        return [EMPTY if n in skipped else next(decoded) for n in range(pending.steps)], held

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

        chunk = Chunk(self.config.epoch, [pending.indices[n] for n in positions],
                      [pending.raws[n] for n in positions], None, pending.first_step)
        if self._decoder.lends_late:
            chunk.on_send = lend
        else:
            lend(chunk)
        try:
            result = await self._decoder.decode(chunk)
        except asyncio.CancelledError:
            raise
        except BaseException:
            if chunk.slot is not None and self._blocks is not None:
                self._lent.discard(chunk.slot.name)
                self._blocks.retire_later(chunk.slot.name)  # its process may have been mid-write
            raise
        self._record(result)
        return result, self._receive(result, chunk.slot, here)

    async def _decode_divided(self, pending: Pending, kept: list[int], parts: int
                              ) -> tuple[ChunkResult, int]:
        """A chunk decoded in `parts` processes at once, its parts joined here (the first
        batch of a pass: every process starts at once, and the batch comes `parts` times
        sooner), then put in a shared block as a decode process would."""
        size = -(-len(kept) // parts)
        pieces = [kept[start:start + size] for start in range(0, len(kept), size)]
        outcomes = await asyncio.gather(
            *(self._decode_part(pending, piece, here=True) for piece in pieces),
            return_exceptions=True)  # every part ends before the chunk does, even on failure
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        decoded = [cast(tuple[ChunkResult, int], outcome)[0] for outcome in outcomes]
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
        joined = join_results(decoded, [len(piece) for piece in pieces], allocate)
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
                f"/dev/shm is too small for a batch of {needed / 2**20:.1f} MiB, so batches come "
                "back pickled (slower). Grow it: docker run --shm-size=2g (or mount a larger "
                "tmpfs on /dev/shm).",
                RuntimeWarning,
                stacklevel=2,
            )

    def _record(self, result: ChunkResult) -> None:
        self._stats.decode.extend(result.durations)
        if result.span is not None:
            self._stats.event(result.process, *result.span, "decode")

    def _failure_of(
        self, pending: Pending, kept: list[int], result: ChunkResult
    ) -> BaseException | None:
        stats = self._stats
        for position, reason in result.skipped:
            key = self._source.key(pending, kept[position])
            stats.record_skip(str(SampleError(pending.indices[kept[position]], key, "decode",
                                              reason)))
        if result.failure is None:
            stats.samples += len(kept) - len(result.skipped)
            return None
        index, reason, text = result.failure
        if index is None:
            error: LoaderError = LoaderError(
                f"collate failed for samples {pending.indices[:8]}: {reason}")
        else:
            position = pending.indices.index(index)
            error = SampleError(index, self._source.key(pending, position), "decode", reason)
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


def _averaged(average: float, value: float, weight: int) -> float:
    """A moving average over about `weight` values, starting at the first one."""
    return value if average == 0 else average + (value - average) / weight
