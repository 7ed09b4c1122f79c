"""One thread per process that does the work finalizers hand it.

A finalizer (`weakref.finalize`, `__del__`) runs wherever the garbage collector or the last
reference drop happens: in any thread, between any two bytecodes, maybe while that thread holds
one of our locks or waits on our zygote. So a finalizer here never blocks and never takes a lock
in place: it puts the work on this queue (`SimpleQueue.put` is safe from finalizers by design)
and the reaper thread does it, in order. Explicit closes run their work in place: they run in a
thread that chose to close.

The thread is started by ordinary code (`start`), never from a finalizer: starting a thread
takes locks of the threading module. At interpreter exit the queue is drained and what is still
alive is shut down in the exiting thread; in a forked child the parent's thread is not there,
and the child starts its own when it first needs one.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

EXIT_SECONDS = 30.0
"""At exit, how long the reaper may go on with what it holds before the rest runs in place."""

_work: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_exiting = False
_pending: weakref.WeakSet[Shutdown] = weakref.WeakSet()


def start() -> None:
    """Make sure this process's reaper runs; call from ordinary code, never a finalizer."""
    global _thread
    if _thread is None or not _thread.is_alive():
        _thread = threading.Thread(target=_reap, name="aioloader-reaper", daemon=True)
        _thread.start()


def later(function: Callable[..., Any], *args: Any) -> None:
    """Run `function(*args)` on the reaper's thread; at exit, here and now."""
    if _exiting:
        _run(function, args)
    else:
        _work.put((function, args))


def on_loop(loop: Any, function: Callable[..., Any], *args: Any) -> None:
    """Run `function(*args)` in `loop` (work on a loop's own objects), or on the reaper's thread
    if that loop is closed. `call_soon_threadsafe` takes no lock of ours and does not block."""
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:
        later(function, *args)


class Shutdown:
    """Ends what `owner` started, once: in place when its owner closes (`__call__`), on the
    reaper's thread when its owner is garbage collected, in the exiting thread at exit."""

    def __init__(self, owner: object, work: Callable[[], Any]) -> None:
        start()
        self._work = work
        self._finalizer = weakref.finalize(owner, later, work)
        self._finalizer.atexit = False  # `_at_exit` runs it, after the reaper stopped
        _pending.add(self)

    def __call__(self) -> None:
        """Run the work here and now, unless it ran or was handed to the reaper already."""
        if self._finalizer.detach() is not None:
            _pending.discard(self)
            self._work()


def _run(function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        function(*args)
    except Exception:  # as a finalizer's error: reported, and the next work goes on
        sys.excepthook(*sys.exc_info())


def _reap() -> None:
    while (item := _work.get()) is not None:
        _run(*item)
        del item  # the work's references go now, not when the next arrives


def _at_exit() -> None:
    """Finish what the reaper holds (bounded), then shut down every owner still alive here:
    daemon threads are stopped abruptly once the interpreter finalizes."""
    global _exiting
    _exiting = True
    if _thread is not None and _thread.is_alive() and _thread is not threading.current_thread():
        _work.put(None)
        _thread.join(EXIT_SECONDS)
    while True:
        try:
            item = _work.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            _run(*item)
    for shutdown in list(_pending):
        shutdown()


def _forget_in_child() -> None:
    """The parent's reaper is not in a forked child: the child starts its own on first use,
    with a queue of its own (the parent's may have been in use at the fork)."""
    global _work, _thread
    _work = queue.SimpleQueue()
    _thread = None


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
