"""Strings packed into two numpy arrays, so millions of keys cost their bytes, not objects."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from .base import digest


class KeyTable:
    """An immutable sequence of str stored as UTF-8 bytes plus end offsets."""

    def __init__(self, keys: Iterable[str]) -> None:
        encoded = [k.encode("utf-8") for k in keys]
        self._ends: npt.NDArray[np.int64] = np.cumsum([len(b) for b in encoded], dtype=np.int64)
        self._data: npt.NDArray[np.uint8] = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> str:
        if not -len(self) <= index < len(self):
            raise IndexError(f"key index {index} out of range for {len(self)} keys")
        index %= len(self)
        start = int(self._ends[index - 1]) if index else 0
        return self._data[start : int(self._ends[index])].tobytes().decode("utf-8")

    @functools.cached_property
    def digest(self) -> str:
        """The keys in order, digested (for a fingerprint), once: the table never changes,
        and a state_dict() each step paid 23 ms for 1.28M keys."""
        return digest(self._data, self._ends)

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes + self._ends.nbytes)
