"""Messages between processes: length-prefixed pickles over a blocking socket, optionally with
descriptors attached. The one framing used both by a decode process's channel and by the
zygote's control socket.

cloudpickle sends functions and classes defined in `__main__`, a notebook or a closure by value,
and round-trips such classes to the same class object, so decode code can live anywhere the
user writes it; everything importable still travels by reference.
"""

from __future__ import annotations

import array
import pickle
import socket
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

if TYPE_CHECKING:  # the zygote and decode processes need no asyncio
    import asyncio

LENGTH = struct.Struct("!Q")
"""The head of every message: the length of the pickle that follows."""
_READ_SIZE = 64 * 1024
MAX_FDS = 4
"""Descriptors one message may carry."""


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message from an asyncio stream in this framing (a loader service's side)."""
    head = await reader.readexactly(LENGTH.size)
    return pickle.loads(await reader.readexactly(LENGTH.unpack(head)[0]))


def frame(data: bytes) -> list[bytes]:
    """A pickled message as it goes on the wire: its head, then its body."""
    return [LENGTH.pack(len(data)), data]


def dumps(value: Any) -> bytes:
    """The standard pickler where it is exact, cloudpickle where it is needed: at 2-3x the
    cost per message, cloudpickle is for what travels by value (anything of `__main__`, a
    closure, a lambda, a module registered by value). The standard one refuses what it cannot
    find by name; a name in `__main__` is found here but not in the other process, so a pickle
    that names `__main__` is made again by cloudpickle."""
    if not cloudpickle.list_registry_pickle_by_value():
        try:
            plain = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            pass  # by value, or not at all: cloudpickle says which
        else:
            if b"__main__" not in plain:
                return plain
    data: bytes = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return data


class Channel:
    """One end of a socket between two processes; `send` and `receive` may run in two
    threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._buffered = b""

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        self.send_bytes(dumps(message), fds)

    def send_bytes(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """One message; `fds` travel with its first byte. Head and body go in one call, so a
        small message arrives whole."""
        head, _ = frame(data)
        descriptors = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sent = self.socket.sendmsg([head, data], descriptors)
        if sent < len(head):
            self.socket.sendall(head[sent:])
        if sent < len(head) + len(data):  # nothing more to send must not meet a closed peer
            self.socket.sendall(memoryview(data)[max(0, sent - len(head)):])

    def receive(self) -> Any:
        """The next message; EOFError once the other side has closed or died. A small
        message usually comes whole in one read; what a read brings past it is kept for the
        next (so a channel read this way is never read with `receive_with_fds`)."""
        buffered = self._buffered
        while len(buffered) < LENGTH.size:
            buffered += self._recv()
        (length,) = LENGTH.unpack_from(buffered)
        end = LENGTH.size + length
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
