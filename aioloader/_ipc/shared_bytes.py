"""A large sample's bytes in shared memory, from the socket they arrived on to the decode process
that takes them: written once where they are read, never pickled, never sent through the
decode channel (which costs two more copies of each byte and a process's time to send them).

The bytes are in a block (`shm`: a memory file with no name) of the process that read them;
what travels is its token. The block lives while that process holds it (until the raw item is
dropped, once its chunk is decoded) and goes with it, however the job ends.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from . import shm


class SharedBytes:
    """Bytes written here, in order, and taken as `bytes` by a process of this machine."""

    def __init__(self, token: str, size: int) -> None:
        self.token = token
        self.nbytes = size

    @classmethod
    def new(cls) -> SharedBytes:
        """An empty block of this process's, held until this object is dropped."""
        token, descriptor = shm.new_block()
        shared = cls(token, 0)
        shared._descriptor = descriptor
        weakref.finalize(shared, os.close, descriptor)
        return shared

    _descriptor = -1

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            written = os.write(self._descriptor, view)
            view = view[written:]
            self.nbytes += written

    def take(self) -> bytes:
        """The bytes, read from the holder's block (FileNotFoundError once it let go)."""
        descriptor = shm.open_block(self.token)
        try:
            parts = []
            offset = 0
            while offset < self.nbytes:  # one read gives at most 2 GiB
                part = os.pread(descriptor, self.nbytes - offset, offset)
                if not part:
                    raise EOFError(f"shared block {self.token} ended at byte {offset} of "
                                   f"{self.nbytes}")
                parts.append(part)
                offset += len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)  # none: b""
        finally:
            os.close(descriptor)

    def __reduce__(self) -> tuple[Any, ...]:
        return SharedBytes, (self.token, self.nbytes)

    def __repr__(self) -> str:
        return f"SharedBytes({self.nbytes} bytes in block {self.token})"


def shared_nbytes(raw: Any) -> int:
    """Bytes of a raw item (or of the first of its parts: `(bytes, label)`) in shared memory."""
    first = raw[0] if isinstance(raw, tuple) and raw else raw
    return first.nbytes if isinstance(first, SharedBytes) else 0
