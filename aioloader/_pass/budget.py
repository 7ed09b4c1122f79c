"""`memory_limit` as one account: what a loader holds, in every process it runs.

The block pool holds the batches that travel through shared memory: those being written,
waiting, and held by the consumer (a block is lent until its last view is gone, in the trainer
or across a service's socket), and idle ones kept for reuse. Each pass holds the rest: raw items
read and not decoded, batches that came back pickled and wait in its heap, and what its chunks
being decoded will hold (their block, and the decoded samples in the decode process on the way
into it). A node's service has one account for all its ranks' passes: the limit is the node's.

Work past the limit waits; the one chunk a waiting consumer needs next goes whatever the room
once no other pass of the account is decoding, so a consumer that keeps every batch still gets
the next (the batches it keeps are its own memory), and a node's ranks, all waiting, go past
the limit by one chunk at a time, not one each. A pass reads ahead (prefetch) only while no
other pass's consumer waits with nothing decoding: a rank's next batch comes before another
rank's prefetch takes the room. Idle blocks are kept only in the room left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .._ipc.transport import BlockPool


class Holder(Protocol):
    """A pass, as the account sees it."""

    @property
    def held_here(self) -> int:
        """Bytes held outside the block pool, or promised to decodes under way."""
        ...

    @property
    def blocks_promised(self) -> int:
        """Of those, the blocks of chunks to be decoded that have no block yet: an idle one
        is theirs to use, not to shed."""
        ...

    @property
    def decoding(self) -> int:
        """Chunks being decoded."""
        ...

    @property
    def starving(self) -> bool:
        """Its consumer waits, and nothing of it is being decoded."""
        ...

    def wake(self) -> None:
        """Room was made: try again what waited for it (called in the pass's loop)."""
        ...


class ReadAhead:
    """What a stream reads ahead of its pass (`_sampling.ReadRoom`): counted from the read's
    start until the stream hands its items over (the pass counts them then, as raw items). A
    holder only while it holds something."""

    blocks_promised = 0
    decoding = 0
    starving = False

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self.held_here = 0

    def fits(self, size: int) -> bool:
        return size <= self._budget.room()

    def hold(self, size: int) -> None:
        if not self.held_here:
            self._budget.join(self)
        self.held_here += size

    def let_go(self, size: int) -> None:
        self.held_here -= size
        if not self.held_here:
            self._budget.leave(self)

    def wake(self) -> None:
        """A stream asks again when its consumer takes an item."""


class MemoryBudget:
    def __init__(self, limit: int, blocks: BlockPool | None = None) -> None:
        self.limit = limit
        self.blocks = blocks
        self._holders: list[Holder] = []
        self.on_shed: list[Callable[[], None]] = []
        """Called after idle blocks may have been removed: a service tells its clients at once,
        as a client's mapping would keep a removed block's memory."""
        self.sample_bytes: float | None = None
        """A decoded sample's bytes, on average, as the passes have learnt it (None: no
        chunk decoded yet); kept from pass to pass, so only a loader's first pass decodes
        one chunk at a time until it knows."""

    def join(self, holder: Holder) -> None:
        self._holders.append(holder)

    def leave(self, holder: Holder) -> None:
        if holder in self._holders:
            self._holders.remove(holder)
        self.freed()

    def held(self) -> int:
        """Bytes held now: blocks that hold a batch (being written, waiting, or with the
        consumer), and what every pass holds besides; idle blocks not (they are shed to fit)."""
        lent = self.blocks.lent_bytes if self.blocks is not None else 0
        return lent + sum(holder.held_here for holder in self._holders)

    def room(self) -> int:
        return self.limit - self.held()

    def others_decoding(self, holder: Holder) -> bool:
        """Whether a pass other than `holder` is decoding (a node's other ranks)."""
        return any(other.decoding for other in self._holders if other is not holder)

    def others_starving(self, holder: Holder) -> bool:
        """Whether the consumer of a pass other than `holder` waits with nothing decoding."""
        return any(other.starving for other in self._holders if other is not holder)

    def wake_others(self, holder: Holder) -> None:
        """`holder` started or ended a decode: the others' turn may have come."""
        for other in list(self._holders):
            if other is not holder:
                other.wake()

    def freed(self) -> None:
        """Something was given back: idle blocks shrink to the room left, and every pass
        tries again what waited for room."""
        if self.blocks is not None:
            promised = sum(holder.blocks_promised for holder in self._holders)
            self.blocks.keep_idle(max(0, self.room()) + promised)
            for tell in list(self.on_shed):
                tell()
        for holder in list(self._holders):
            holder.wake()

    def on_block_released(self, call_in_loop: Callable[[Callable[[], None]], None]) -> None:
        """Blocks come back from other threads (a view collected in the trainer, a service's
        client): `call_in_loop` runs `freed` in the passes' loop then."""
        if self.blocks is not None:
            self.blocks.on_release = lambda: call_in_loop(self.freed)
