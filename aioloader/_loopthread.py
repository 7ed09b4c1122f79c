"""An event loop (uvloop when installed) running in one background thread, for plain `for`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._errors import LoaderError, StallError

T = TypeVar("T")
POLL_SECONDS = 0.5
STOP_SECONDS = 10.0


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class LoopThread:
    """Owns a loop and its thread; `call` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="aioloader-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """Run `coroutine` on the loop and wait `timeout` seconds at most for `what` it gives
        (StallError past that: a wedged loop or a lock it waits on, never a hang); wait in
        short polls so a dead thread cannot hang us."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    return future.result(timeout=POLL_SECONDS)
                except concurrent.futures.TimeoutError:
                    if not self._thread.is_alive():
                        raise LoaderError("the loader's event loop thread ended") from None
                    if time.monotonic() >= deadline:
                        raise StallError(
                            f"the loader's event loop gave no {what} within {timeout:g} s"
                        ) from None
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: do not leave the coroutine running
            raise

    def alive(self) -> bool:
        """False once the thread ended, as it does at interpreter exit (a daemon)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(STOP_SECONDS)


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` on a loop of its own in a helper thread and return its result.

    Works from plain code and from inside a running loop alike (which it blocks meanwhile):
    datasets use it to load their metadata at construction, so `len()` works at once.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioloader-setup") as pool:
        return pool.submit(asyncio.run, coroutine).result()
