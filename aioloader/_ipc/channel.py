"""Messages between processes: length-prefixed pickles over a blocking socket, optionally with
descriptors attached. The one framing used both by a decode process's channel and by the
zygote's control socket.

cloudpickle sends functions and classes defined in `__main__`, a notebook or a closure by value,
and round-trips such classes to the same class object, so decode code can live anywhere the
user writes it; everything importable still travels by reference.
"""

from __future__ import annotations

import array
import collections
import contextlib
import copyreg
import dataclasses
import io
import pickle
import socket
import struct
import types
from collections.abc import Iterator, Sequence
from multiprocessing import context as mp_context
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, NoReturn

import cloudpickle

from . import shm

if TYPE_CHECKING:  # the zygote and decode processes need no asyncio
    import asyncio

LENGTH = struct.Struct("!Q")
"""The head of every message: the length of the pickle that follows."""
_READ_SIZE = 64 * 1024
MAX_FDS = 4
"""Descriptors one message may carry."""
PARTS_PER_CALL = 512
"""Buffers given to one `sendmsg` (the kernel takes at most 1024)."""


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message from an asyncio stream in this framing (a loader service's side)."""
    head = await reader.readexactly(LENGTH.size)
    return pickle.loads(await reader.readexactly(LENGTH.unpack(head)[0]))


Parts = list[memoryview]
"""A message pickled as the pickler wrote it (`dumps_data`), one byte-format view per write."""


def frame(data: bytes | Parts) -> list[bytes | memoryview]:
    """A pickled message as it goes on the wire: its head, then its body (in parts)."""
    if isinstance(data, bytes):
        return [LENGTH.pack(len(data)), data]
    return [LENGTH.pack(sum(part.nbytes for part in data)), *data]


def dumps(value: Any) -> bytes:
    """cloudpickle: what travels once (a decode spec, a configuration, an environment) may hold
    anything a user writes, sent by value where it must be, multiprocessing's shared objects
    included (`_AsIfSpawning`)."""
    buffer = io.BytesIO()
    with _as_if_spawning():
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's, with multiprocessing's own reducers for the memory and the pipes behind
    its shared objects (which it registers with its ForkingPickler only, ctypes types as it
    makes them)."""

    @property
    def dispatch_table(self) -> collections.ChainMap[Any, Any]:
        return collections.ChainMap(
            {kind: reduce for kind, reduce in ForkingPickler._extra_reducers.items()  # type: ignore[attr-defined]
             if reduce.__module__ in _SHARING_MODULES},
            cloudpickle.Pickler.dispatch_table)


_SHARING_MODULES = ("multiprocessing.heap", "multiprocessing.connection",
                    "multiprocessing.sharedctypes")


class _AsIfSpawning:
    """What multiprocessing asks of a process being spawned. Its shared objects (`Value`,
    `Array`, `Lock`, `Semaphore`, a `Queue`) pickle only then, as DataLoader's workers inherit
    them: semaphores by name, memory and pipes by descriptor. Decode processes are not forked
    from this one, so a descriptor is opened where it arrives as `/proc/PID/fd/N`, which only
    the same user may open (as blocks are, `shm.open_block`). A semaphore made in a fork
    context has no name left, and multiprocessing refuses it."""

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd

    @staticmethod
    def DupFd(fd: int) -> _Descriptor:
        return _Descriptor(shm.token_of(fd))


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    """A descriptor of another process, opened on `detach` as multiprocessing's `DupFd`, and
    checked as a block's is (its inode, its owner)."""

    token: str

    def detach(self) -> int:
        return shm.open_block(self.token)


@contextlib.contextmanager
def _as_if_spawning() -> Iterator[None]:
    """For this thread only, as multiprocessing's own spawning is."""
    previous = mp_context.get_spawning_popen()
    mp_context.set_spawning_popen(_AsIfSpawning())  # type: ignore[arg-type]
    try:
        yield
    finally:
        mp_context.set_spawning_popen(previous)


def dumps_data(value: Any) -> Parts:
    """The messages of every chunk (its raw items, its result, a batch to the trainer): the
    standard pickler, at a third to a half of cloudpickle's cost per message, where it is
    exact (`_ByName`); what it refuses goes by cloudpickle, as does everything when a module is
    registered to travel by value. In parts, as the pickler writes them: a large `bytes` or
    array goes to the socket from its own memory, never copied into a pickle nor searched."""
    if not cloudpickle.list_registry_pickle_by_value():
        parts = _Written()
        try:
            _ByName(parts, pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception:
            pass  # by value, or not at all: cloudpickle says which
        else:
            return parts
    return [memoryview(dumps(value))]


class _Written(list[memoryview]):
    """A pickler's file that keeps what it is given: its frames, and each payload of 64 KiB or
    more (a bytes object, an array's buffer) as it is, which the C pickler writes alone."""

    def write(self, data: Any) -> None:
        self.append(data.raw() if isinstance(data, pickle.PickleBuffer)
                    else memoryview(data).cast("B"))


def _refuse(what: str) -> NoReturn:
    raise pickle.PicklingError(f"{what} goes by value")


_METHODS_REFUSED = {**copyreg.dispatch_table, types.MethodType: lambda _: _refuse("a method")}


class _ByName(pickle.Pickler):
    """The standard pickler, refusing what it would save by a name the other process cannot
    find or may read otherwise: a class or function of `__main__` (found here, not there),
    and a bound method (saved as its object's attribute of the function's name, which a
    decorator may have changed)."""

    dispatch_table = _METHODS_REFUSED

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            _refuse(f"{obj.__qualname__} of __main__")
        return NotImplemented


class Channel:
    """One end of a socket between two processes; `send` and `receive` may run in two
    threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._buffered = b""
        self.received = 0
        """Bytes of the last message `receive` gave, its head included."""

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        self.send_bytes(dumps(message), fds)

    def send_bytes(self, data: bytes | Parts, fds: Sequence[int] = ()) -> None:
        """One message; `fds` travel with its first byte. Head and body go in one call (a few
        hundred parts at a time), so a small message arrives whole."""
        pending = [memoryview(part).cast("B") for part in frame(data)]
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        first = 0
        while first < len(pending):  # nothing more to send must not meet a closed peer
            sent = self.socket.sendmsg(pending[first:first + PARTS_PER_CALL], ancillary)
            ancillary = []
            while sent:
                taken = min(sent, pending[first].nbytes)
                pending[first] = pending[first][taken:]
                sent -= taken
                first += not pending[first].nbytes
            while first < len(pending) and not pending[first].nbytes:  # empty parts
                first += 1

    def receive(self) -> Any:
        """The next message; EOFError once the other side has closed or died. A small
        message usually comes whole in one read; what a read brings past it is kept for the
        next (so a channel read this way is never read with `receive_with_fds`)."""
        buffered = self._buffered
        while len(buffered) < LENGTH.size:
            buffered += self._recv()
        (length,) = LENGTH.unpack_from(buffered)
        end = self.received = LENGTH.size + length
        if len(buffered) >= end:
            self._buffered = buffered[end:]
            return pickle.loads(memoryview(buffered)[LENGTH.size:end])
        self._buffered = b""
        body = bytearray(length)
        have = len(buffered) - LENGTH.size
        body[:have] = memoryview(buffered)[LENGTH.size:]
        self._fill(memoryview(body)[have:])
        return pickle.loads(body)

    @property
    def buffered(self) -> bool:
        """Bytes of the next message were read already: `receive` needs no wait for them
        to come (a caller waiting for the socket to be readable would wait forever)."""
        return bool(self._buffered)

    def _recv(self) -> bytes:
        data = self.socket.recv(_READ_SIZE)
        if not data:
            raise EOFError("the other end of the channel closed")
        return data

    def receive_with_fds(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors sent with it (now this process's to close)."""
        head, fds, _, _ = socket.recv_fds(self.socket, LENGTH.size, MAX_FDS)
        if not head:
            raise EOFError("the other end of the channel closed")
        (length,) = LENGTH.unpack(head + self._exactly(LENGTH.size - len(head)))
        return pickle.loads(self._exactly(length)), list(fds)

    def _exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        self._fill(memoryview(buffer))
        return buffer

    def _fill(self, view: memoryview) -> None:
        received = 0
        while received < len(view):
            count = self.socket.recv_into(view[received:])
            if count == 0:
                raise EOFError("the other end of the channel closed")
            received += count

    def close(self) -> None:
        self.socket.close()
