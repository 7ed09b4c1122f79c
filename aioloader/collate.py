"""Turning a list of samples into one batch of numpy arrays, as torch's default_collate does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def default_collate(samples: Sequence[Any]) -> Any:
    """Stack arrays and scalars along a new first axis, recursing into dicts and sequences.

    numpy arrays -> np.stack; bool, int, float (Python or numpy scalars) -> a 1-d array
    (int64 and float64 for Python numbers, as torch does); str and bytes -> a list, as torch does;
    dicts -> a dict of collated values; tuples, namedtuples and lists -> the same type of
    collated fields. Samples must share one structure.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    first = samples[0]
    if isinstance(first, np.ndarray):
        _check_same_shapes(samples)
        return np.stack(samples)
    if isinstance(first, np.generic):
        return np.array(samples, dtype=first.dtype)
    if isinstance(first, bool):
        return np.array(samples, dtype=np.bool_)
    if isinstance(first, int):
        return np.array(samples, dtype=np.int64)
    if isinstance(first, float):
        return np.array(samples, dtype=np.float64)
    if isinstance(first, (str, bytes)):
        return list(samples)
    if isinstance(first, Mapping):
        collated = {key: default_collate([s[key] for s in samples]) for key in first}
        return collated if type(first) is dict else type(first)(collated)  # type: ignore[call-arg]
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(default_collate(field) for field in zip(*samples, strict=True)))
    if isinstance(first, (tuple, list)):
        if any(len(s) != len(first) for s in samples):
            raise ValueError("each sample in a batch must have the same number of fields")
        return type(first)(default_collate(field) for field in zip(*samples, strict=True))
    raise TypeError(
        f"default_collate does not know how to batch {type(first).__name__}; "
        "pass collate= to the Loader"
    )


def _check_same_shapes(arrays: Sequence[np.ndarray[Any, Any]]) -> None:
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(
            f"cannot stack arrays of different shapes {sorted(shapes)}; "
            "resize in decode or pass collate="
        )
