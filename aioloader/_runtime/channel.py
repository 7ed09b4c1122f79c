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
from typing import Any

import cloudpickle

_LENGTH = struct.Struct("!Q")
MAX_FDS = 4
"""Descriptors one message may carry."""


def dumps(value: Any) -> bytes:
    data: bytes = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return data


class Channel:
    """One end of a socket between two processes; `send` and `receive` may run in two
    threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        self.send_bytes(dumps(message), fds)

    def send_bytes(self, data: bytes, fds: Sequence[int] = ()) -> None:
        """One message; `fds` travel with its first byte. Head and body go in one call, so a
        small message arrives whole."""
        head = _LENGTH.pack(len(data))
        descriptors = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sent = self.socket.sendmsg([head, data], descriptors)
        if sent < len(head):
            self.socket.sendall(head[sent:])
        self.socket.sendall(memoryview(data)[max(0, sent - len(head)):])

    def receive(self) -> Any:
        """The next message; EOFError once the other side has closed or died."""
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        return pickle.loads(self._exactly(length))

    def receive_with_fds(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors sent with it (now this process's to close)."""
        head, fds, _, _ = socket.recv_fds(self.socket, _LENGTH.size, MAX_FDS)
        if not head:
            raise EOFError("the other end of the channel closed")
        (length,) = _LENGTH.unpack(head + self._exactly(_LENGTH.size - len(head)))
        return pickle.loads(self._exactly(length)), list(fds)

    def _exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        received = 0
        while received < size:
            count = self.socket.recv_into(view[received:])
            if count == 0:
                raise EOFError("the other end of the channel closed")
            received += count
        return buffer

    def close(self) -> None:
        self.socket.close()
