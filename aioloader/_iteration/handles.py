"""A pass as a Loader drives it, wherever it runs: one `Handle` (`next`, `next_async`, `close`,
`aclose`, `drop`, `position`) of two kinds, a pass run in an event loop of this process
(`LocalHandle`) and a pass run in a loader service (`ServiceHandle`).

The kind is chosen once per iteration (`Runner`), as PyTorch's `_get_iterator` chooses its
iterator class; `Iteration` (`for`) and `AsyncIteration` (`async for`) drive either one. A handle
tells its `ended` callback once, however the pass ends: finished, closed, failed or dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .. import _reaper as reaper
from .._blocking import off_loop
from .._errors import LoaderError
from .._loopthread import LoopThread
from .._pass.factory import PassFactory
from .._pass.pipeline import END, Pass
from .._sampling import Intervals
from .._service.client import EXTRA_SECONDS, ServiceClient
from .._stats import now

CLOSE_WAIT_SECONDS = 5.0
"""How long closing a Loader from another thread waits for its running pass to close."""


@dataclass(frozen=True)
class Opening:
    """What a pass is opened with: where it starts, what builds it, whom to tell it ended."""

    epoch: int
    start: int
    remaining: Intervals | None
    copies: dict[str, Any] | None
    """An IterableDataset's: where each worker's copy resumes (`IterableSource`)."""
    factory: PassFactory
    client: Callable[[], ServiceClient]
    """The loader service's client, the service started if need be."""
    ended: Callable[[Handle], None]


class Handle(ABC):
    """One running pass. `next`/`close` serve `for`, `next_async`/`aclose` serve `async for`;
    `drop` is for a finalizer (never blocks) and `interrupt` for `Loader.close` in any thread."""

    dropped = False
    """Its iterator was dropped mid-pass: the release is on its way (a finalizer handed it
    over), and the next pass waits for it."""

    @classmethod
    @abstractmethod
    def open(cls, opening: Opening) -> Handle:
        """A started pass, for `for`."""

    @classmethod
    @abstractmethod
    async def open_async(cls, opening: Opening) -> Handle:
        """A started pass, for `async for` in the running loop."""

    @property
    @abstractmethod
    def position(self) -> int:
        """Where the pass stands: the position after the last batch handed over."""

    @property
    @abstractmethod
    def copies(self) -> dict[str, Any] | None:
        """An IterableDataset's: where each worker's copy stands after the last batch handed
        over (`IterableSource.copies`)."""

    @property
    @abstractmethod
    def goes_on(self) -> bool:
        """After `next` raised: the pass goes on with the next batch (one batch failed, as a
        DataLoader goes on after an error a worker re-raised); else it is over."""

    @abstractmethod
    def next(self) -> Any:
        """The next batch, or END (the pass is then closed)."""

    @abstractmethod
    async def next_async(self) -> Any: ...

    @abstractmethod
    def close(self) -> None:
        """End the pass (early: what was made ahead is dropped); idempotent."""

    @abstractmethod
    async def aclose(self) -> None: ...

    @abstractmethod
    def drop(self) -> None:
        """From a finalizer: hand the release over, without blocking or taking a lock."""

    @abstractmethod
    def settle_here(self) -> None:
        """A drop whose release is queued on the running loop is done now."""

    @abstractmethod
    def interrupt(self, error: LoaderError, foreign: bool) -> None:
        """The Loader closes (in any thread; `foreign`: in a forked child): the pass raises
        `error` at its next batch."""


class LocalHandle(Handle):
    """A pass run in an event loop here: a loop thread of its own for `for`, the caller's loop
    for `async for`."""

    def __init__(self, running: Pass, thread: LoopThread | None, opening: Opening) -> None:
        self._pass = running
        self._thread = thread
        self._ended = opening.ended
        self._bound = _bound(opening.factory)
        self._over = False

    @classmethod
    def open(cls, opening: Opening) -> Handle:
        thread = LoopThread()
        try:
            return thread.call(cls._opened(opening, thread), _bound(opening.factory), "new pass")
        except BaseException:
            thread.stop()
            raise

    @classmethod
    async def open_async(cls, opening: Opening) -> Handle:
        return await cls._opened(opening, None)

    @classmethod
    async def _opened(cls, opening: Opening, thread: LoopThread | None) -> Handle:
        running = await opening.factory.open(opening.epoch, opening.start, opening.remaining,
                                             opening.copies)
        return cls(running, thread, opening)

    @property
    def position(self) -> int:
        return self._pass.position

    @property
    def copies(self) -> dict[str, Any] | None:
        return self._pass.copies

    @property
    def goes_on(self) -> bool:
        return not self._over and self._pass.goes_on

    def next(self) -> Any:
        assert self._thread is not None, "opened for async for"
        return self._thread.call(self.next_async(), self._bound, "batch")

    async def next_async(self) -> Any:
        item = await self._pass.next()
        if item is END:
            await self._close()
        return item

    def close(self) -> None:
        """Close the pass in its loop thread, then stop the thread (not at interpreter exit,
        where the thread has ended)."""
        assert self._thread is not None, "opened for async for"
        try:
            if self._thread.alive():
                self._thread.call(self._close(), self._bound, "end of the pass")
        finally:
            self._thread.stop()

    async def aclose(self) -> None:
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        if self._over:
            return
        self._over = True
        try:
            await self._pass.aclose()
        finally:
            self._ended(self)

    def drop(self) -> None:
        """The release goes to the pass's loop (docs/design.md, finalizers)."""
        if not self._over:
            self.dropped = True
            reaper.on_loop(self._pass.loop, self._abandon)

    def _abandon(self) -> None:
        if self._over:
            return
        self._over = True
        try:
            self._pass.abandon()
        finally:
            self._ended(self)

    def settle_here(self) -> None:
        if self.dropped and _in_loop(self._pass.loop):
            self._abandon()

    def interrupt(self, error: LoaderError, foreign: bool) -> None:
        loop = self._pass.loop
        if _in_loop(loop) or foreign:  # a fork's pass: the parent's
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._pass.fail, error)
        else:  # closed here, in its loop: a suspended `for` need not come back for it
            with contextlib.suppress(RuntimeError, concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(self._fail(error), loop
                                                 ).result(CLOSE_WAIT_SECONDS)

    async def _fail(self, error: LoaderError) -> None:
        self._pass.fail(error)
        await self._close()


class ServiceHandle(Handle):
    """A pass run in a loader service: the batches arrive on its client's socket."""

    def __init__(self, client: ServiceClient, opening: Opening) -> None:
        self._client = client
        self._position = opening.start
        self._copies = opening.copies
        self._stats = opening.factory.stats
        self._ended = opening.ended
        self._finished = False
        self._over = False
        self._handed_at: float | None = None

    @classmethod
    def open(cls, opening: Opening) -> Handle:
        client = opening.client()
        client.open(opening.epoch, opening.start, opening.remaining, opening.copies)
        return cls(client, opening)

    @classmethod
    async def open_async(cls, opening: Opening) -> Handle:
        """Opened on a thread (it may start the service); a caller cancelled meanwhile still
        stops the pass once it is open."""
        opened = asyncio.ensure_future(off_loop(cls.open, opening))
        try:
            return await asyncio.shield(opened)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await (await opened).aclose()
            raise

    @property
    def position(self) -> int:
        return self._position

    @property
    def copies(self) -> dict[str, Any] | None:
        return self._copies

    @property
    def goes_on(self) -> bool:
        client = self._client
        return not self._over and client.pass_open and client.broken is None

    def next(self) -> Any:
        asked = now()
        return self._delivered(self._client.next(), asked)

    async def next_async(self) -> Any:
        asked = now()
        return self._delivered(await self._client.next_async(), asked)

    def _delivered(self, got: tuple[Any, int, dict[str, Any] | None] | None, asked: float
                   ) -> Any:
        """Book a batch handed over: the position after it, the wait for it."""
        if got is None:
            self._finished = True
            self.close()
            return END
        item, self._position, self._copies = got
        stats, arrived = self._stats, now()
        stats.batches += 1
        stats.consumer_wait.add(arrived - asked)
        if self._handed_at is not None:
            stats.consumer_work.add(asked - self._handed_at)
        self._handed_at = arrived
        stats.event("consumer", asked, arrived, "wait")
        return item

    def close(self, wait: bool = True) -> None:
        """The service drops what it made ahead; `wait`: until it has."""
        if self._over:
            return
        self._over = True
        try:
            client = self._client
            if not self._finished and client.pass_open and not client.closed:
                with contextlib.suppress(LoaderError):
                    client.stop(wait)
        finally:
            self._ended(self)

    async def aclose(self) -> None:
        if not self._over:
            await off_loop(self.close)

    def drop(self) -> None:
        """The stop goes to the reaper's thread (docs/design.md, finalizers)."""
        if not self._over:
            self.dropped = True
            reaper.later(self.close, False)

    def settle_here(self) -> None:
        """A dropped pass's stop is on the reaper's thread, not queued on a loop."""

    def interrupt(self, error: LoaderError, foreign: bool) -> None:
        """Nothing to do here: the Loader's close ends the service, and the client then
        raises at the next batch."""


class Iteration:
    """`for` over `owner` (kept alive while it runs): the pass opens at the first `next()`.
    After an error of one batch, the next `next()` goes on with the following batch, as with
    DataLoader; any other error, a `break` (the iterator dropped) or Ctrl-C closes the pass."""

    def __init__(self, owner: object, open_handle: Callable[[], Handle]) -> None:
        self._owner: object = owner
        self._open = open_handle
        self._handle: Handle | None = None
        self._done = False

    def __iter__(self) -> Iteration:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._handle is None:
            try:
                self._handle = self._open()
            except BaseException:
                self._done = True
                raise
        handle = self._handle
        try:
            item = handle.next()
        except Exception:
            if not handle.goes_on:
                self._end()
            del self, handle  # a notebook keeps the exception, and with it this frame
            raise
        except BaseException:  # Ctrl-C, an exit: the pass ends with it
            self._end()
            del self, handle
            raise
        if item is END:
            self._end(quietly=False)
            raise StopIteration
        return item  # held by the trainer alone: `del batch` frees its block

    def _end(self, quietly: bool = True) -> None:
        """Close the pass (`quietly`: what the caller sees is an error already) and let go of
        the owner."""
        handle, self._handle, self._owner, self._done = self._handle, None, None, True
        if handle is None:
            return
        if quietly:
            with contextlib.suppress(LoaderError):
                handle.close()
        else:
            handle.close()

    def close(self) -> None:
        """End the pass before its end, as a `break` does."""
        self._end()

    def __del__(self) -> None:
        """A `break`: the pass closes here, bounded (docs/design.md, finalizers)."""
        if self._handle is not None:
            self._end()


class AsyncIteration:
    """`async for` over `owner` (kept alive while it runs). Dropping it mid-pass (a `break`)
    releases the pass at once, so the next `async for` starts cleanly even before the old one
    is finalized."""

    def __init__(self, owner: object,
                 open_async: Callable[[list[Handle]], Awaitable[None]]) -> None:
        self._owner = owner
        self._open = open_async
        self._opened: list[Handle] = []
        """The handle, put here as soon as it exists: a caller cancelled meanwhile still
        closes it."""
        self._done = False

    def __aiter__(self) -> AsyncIteration:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        if not self._opened:
            await self._open(self._opened)
        handle = self._opened[0]
        try:
            item = await handle.next_async()
        except Exception:
            if not handle.goes_on:  # else one batch failed: the next __anext__ goes on
                await self.aclose()
            del self, handle  # a notebook keeps an interrupted cell's exception, and this frame
            raise
        except BaseException:  # cancelled, Ctrl-C: the pass ends with it
            await self.aclose()
            del self, handle
            raise
        if item is END:
            self._done = True
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        if self._opened and not self._done:
            self._done = True
            await self._opened[0].aclose()

    def __del__(self) -> None:
        if self._opened and not self._done:
            self._done = True
            self._opened[0].drop()


def _bound(factory: PassFactory) -> float:
    return factory.config.stall_timeout + EXTRA_SECONDS


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    with contextlib.suppress(RuntimeError):
        return asyncio.get_running_loop() is loop
    return False
