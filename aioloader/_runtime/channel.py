"""Messages between the main process and a decode process: length-prefixed cloudpickles over a
blocking socket.

cloudpickle sends functions and classes defined in `__main__`, a notebook or a closure by value,
and round-trips such classes to the same class object, so decode code can live anywhere the
user writes it; everything importable still travels by reference.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

import cloudpickle

_LENGTH = struct.Struct("!Q")


def dumps(value: Any) -> bytes:
    data: bytes = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return data


class Channel:
    """One end of a decode process's socket; `send` and `receive` may run in two threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock

    def send(self, message: Any) -> None:
        self.send_bytes(dumps(message))

    def send_bytes(self, data: bytes) -> None:
        self.socket.sendall(_LENGTH.pack(len(data)))
        self.socket.sendall(data)

    def receive(self) -> Any:
        """The next message; EOFError once the other side has closed or died."""
        (length,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        return pickle.loads(self._exactly(length))

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
