"""A Loader's passes, one at a time: where it stands in the epochs (`Position`, one value with
one owner), the handle of the running pass, and closing it from any thread.

The kind of handle (`handles.LocalHandle` or `handles.ServiceHandle`) is chosen here, once,
when the Runner is made; nothing else branches on where passes run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from .._errors import LoaderError
from .._pass.factory import PassFactory
from .._sampling import Intervals
from .._service.holder import ServiceHolder
from .handles import CLOSE_WAIT_SECONDS, Handle, LocalHandle, Opening, ServiceHandle


@dataclass(frozen=True)
class Position:
    """Where a Loader stands: replaced, never changed in place."""

    epoch: int = 0
    position: int = 0
    """Where the running pass began: the global position in the epoch's order (map-style
    data), or the items this rank had handed over (streams); 0 between passes."""
    resume_at: int | None = None
    """Where the next pass starts, set by `load_state_dict`; None: the epoch's beginning."""
    remaining: Intervals | None = None
    """Streams divided by samples: what the last pass (or the next, when resuming) divides
    among the ranks; None for the whole epoch."""
    copies: dict[str, Any] | None = None
    """An IterableDataset resumed: where each worker's copy resumes (`IterableSource`)."""

    def started(self) -> Position:
        """Where a pass starts: the resume point, else the beginning of the epoch."""
        if self.resume_at is None:
            return Position(self.epoch)
        return Position(self.epoch, self.resume_at, None, self.remaining, self.copies)

    def ended(self) -> Position:
        """Where a pass leaves the Loader, whether it finished or was broken off: at the next
        epoch's beginning, so a new `iter()` starts a new order, as DataLoader's does (a
        `break`, `zip(range(n), loader)`, Lightning's `limit_train_batches`), and
        `state_dict()` says so. To resume mid-epoch, save `state_dict()` inside the loop."""
        return Position(self.epoch + 1)

    @property
    def start(self) -> int:
        """Where the next pass starts (the running one started), in the units of `position`."""
        return self.resume_at if self.resume_at is not None else self.position

    def at_epoch(self, epoch: int) -> Position:
        """The beginning of `epoch`; a resume point in that same epoch is kept, as a training
        loop that resumes and then calls `set_epoch(epoch)` expects."""
        if self.resume_at is not None and epoch == self.epoch:
            return self
        return Position(epoch)


class Runner:
    """Opens a Loader's passes where its configuration says (here or in its service), one at
    a time, and books where each one leaves the Loader."""

    def __init__(self, factory: PassFactory, service: ServiceHolder) -> None:
        self._factory = factory
        self._service = service
        self._kind: type[Handle] = ServiceHandle if factory.config.service else LocalHandle
        self._at = Position()
        self._handle: Handle | None = None
        self._opening = False
        self._closed = False
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)

    @property
    def at(self) -> Position:
        return self._at

    @property
    def position(self) -> int:
        """Where the running pass stands, else where the last one stood."""
        handle = self._handle
        return handle.position if handle is not None else self._at.position

    @property
    def copies(self) -> dict[str, Any] | None:
        """An IterableDataset's: where the workers' copies stand, as `position`."""
        handle = self._handle
        return handle.copies if handle is not None else self._at.copies

    def move(self, at: Position) -> None:
        """`set_epoch`, `load_state_dict`: the next pass starts at `at`."""
        with self._lock:
            self._at = at

    def start(self) -> None:
        """`Loader.start`: what a pass at the current position would wait for, started now;
        nothing while a pass runs (it started them)."""
        self._factory.pools.check_process()
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            if self._handle is not None or self._opening:
                return
            epoch = self._at.epoch
        config = self._factory.config
        if config.service is None:
            self._factory.start_decoding(epoch)
        else:
            self._service.start(config).start_decoding(epoch)

    def open(self) -> Handle:
        """A started pass for `for`."""
        self._factory.pools.check_process()
        opening = self._reserve()
        try:
            handle = self._kind.open(opening)
        except BaseException:
            self._unreserve()
            raise
        return self._running(handle)

    async def open_async(self, opened: list[Handle]) -> None:
        """A started pass for `async for`, put in `opened` as soon as it exists."""
        self._factory.pools.check_process()
        dropped = self._handle
        if dropped is not None:
            dropped.settle_here()  # its release, queued on this loop, has not run yet
        opening = self._reserve()
        try:
            handle = await self._kind.open_async(opening)
        except BaseException:
            self._unreserve()
            raise
        opened.append(self._running(handle))

    def _reserve(self) -> Opening:
        """A pass whose iterator was dropped is given a bounded wait for its release, which a
        finalizer handed to the reaper or the pass's loop."""
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            if self._handle is not None and self._handle.dropped:
                self._ended.wait_for(lambda: self._handle is None, CLOSE_WAIT_SECONDS)
            if self._handle is not None or self._opening:
                raise LoaderError(
                    "a pass over this Loader is already running (in another thread or task); "
                    "a Loader runs one pass at a time: finish or break that loop first"
                )
            self._opening = True
            self._at = at = self._at.started()
        config = self._factory.config
        return Opening(at.epoch, at.position, at.remaining, at.copies, self._factory,
                       lambda: self._service.start(config, for_a_pass=True), self._pass_ended)

    def _unreserve(self) -> None:
        with self._lock:
            self._opening = False

    def _running(self, handle: Handle) -> Handle:
        with self._lock:
            self._handle, self._opening, closed = handle, False, self._closed
        if closed:  # closed while the pass was being opened
            handle.interrupt(LoaderError("the Loader was closed"), self._factory.pools.foreign)
        return handle

    def _pass_ended(self, handle: Handle) -> None:
        with self._lock:
            if self._handle is not handle:
                return
            self._at = self._at.ended()
            self._handle = None
            self._ended.notify_all()

    def close(self) -> None:
        """No pass opens from now on; a running one raises LoaderError at its next batch."""
        with self._lock:
            self._closed = True
            handle = self._handle
        if handle is not None:
            handle.interrupt(LoaderError("the Loader was closed while a pass was running"),
                             self._factory.pools.foreign)
