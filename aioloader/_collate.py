"""Turning a list of samples into one batch of numpy arrays, as torch's default_collate does."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

Allocate = Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray[Any, Any]]


class Stacked:
    """In place of a sample's array that is already in its row of the batch array: collate
    takes that batch array (one marker, shared by every sample, for each array of the sample).
    A decode process stacks rows as samples come, so it holds one sample, not a batch."""

    __slots__ = ("batch",)

    def __init__(self, batch: np.ndarray[Any, Any]) -> None:
        self.batch = batch


def default_collate(samples: Sequence[Any], allocate: Allocate | None = None) -> Any:
    """Stack arrays and scalars along a new first axis, recursing into dicts and sequences.

    numpy arrays (and array-likes such as torch tensors) -> np.stack; bool, int, float (Python
    or numpy scalars) -> a 1-d array (int64 and float64 for Python numbers, as torch does;
    mixed dtypes are promoted, never cast to the first sample's); str and bytes -> a list, as
    torch does; torch tensors -> arrays (detached; bfloat16, which numpy lacks, stacked by
    torch); arrays of text or objects -> TypeError, as torch's;
    dicts -> a dict of collated values; tuples, namedtuples and lists -> the same type of
    collated fields. Samples must share one structure. `allocate(shape, dtype)`, when given,
    provides the memory of each stacked array (the loader passes shared memory: one copy less).
    """
    if len(samples) == 0:
        raise ValueError("cannot collate an empty list of samples")
    first = samples[0]
    if isinstance(first, Stacked):
        return first.batch
    if isinstance(first, (str, bytes)):  # numpy's str_ and bytes_ too: text, not numbers
        return samples if isinstance(samples, np.ndarray) else list(samples)
    if isinstance(first, np.ndarray):
        if first.dtype.kind in "SaUO":
            raise TypeError(f"default_collate: batch must contain arrays of numbers, numbers, "
                            f"dicts or sequences; found an array of {first.dtype}")
        check_same_shapes(samples)
        if allocate is None:
            return np.stack(samples)
        dtype = np.result_type(*samples)  # as without `allocate`: widened, never cut
        return np.stack(samples, out=allocate((len(samples), *first.shape), dtype))
    scalar_type = scalar_dtype(first)
    if scalar_type is not None:
        types = {scalar_dtype(s) for s in samples}
        if len(types) > 1 and None not in types:  # promoted, as torch does: never truncated
            scalar_type = np.result_type(*(t for t in types if t is not None))
        array = np.array(samples, dtype=scalar_type)
        if allocate is None:
            return array
        out = allocate(array.shape, array.dtype)
        out[...] = array
        return out
    if _is_tensor(first):
        return _tensors(samples, allocate)
    if hasattr(first, "__array__") and not isinstance(first, (Mapping, tuple, list)):
        # torch tensors and other array-likes: as arrays (CPU tensors without a copy)
        return default_collate([np.asarray(s) for s in samples], allocate)

    if (isinstance(first, Sequence) and not hasattr(first, "_fields")
            and any(len(s) != len(first) for s in samples)):
        raise RuntimeError("each sample in a batch must have the same number of fields "
                           "(torch's default_collate raises a RuntimeError too)")
    collated = by_field(samples, lambda part: default_collate(part, allocate))
    if collated is NotImplemented:
        raise TypeError(
            f"default_collate does not know how to batch {type(first).__name__}; "
            "pass collate= to the Loader"
        )
    return collated


def concatenate(batches: Sequence[Any], allocate: Allocate | None = None) -> Any:
    """Batches that `default_collate` made of consecutive parts of a list of samples, joined
    into the batch it would have made of the whole list (a pass's first batch is decoded in
    parts, by every decode process at once); `allocate` as for `default_collate`."""
    first = batches[0]
    if isinstance(first, np.ndarray):
        check_same_shapes([batch[0] for batch in batches])  # one sample of each part
        if allocate is None:
            return np.concatenate(batches)
        shape = (sum(len(batch) for batch in batches), *first.shape[1:])
        return np.concatenate(batches, out=allocate(shape, np.result_type(*batches)))
    if isinstance(first, list) and all(isinstance(v, (str, bytes)) for v in first):
        return [value for batch in batches for value in batch]
    joined = by_field(batches, lambda part: concatenate(part, allocate))
    if joined is NotImplemented:
        raise TypeError(f"cannot join batches of {type(first).__name__}")
    return joined


def by_field(values: Sequence[Any], combine: Callable[[Sequence[Any]], Any]) -> Any:
    """Dicts, namedtuples, tuples or lists of one structure (samples, or batches), as that
    structure of `combine` over each field's values; NotImplemented for anything else."""
    first = values[0]
    if isinstance(first, Mapping):
        combined = {key: combine([value[key] for value in values]) for key in first}
        return combined if type(first) is dict else type(first)(combined)  # type: ignore[call-arg]
    if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
        return type(first)(*(combine(field) for field in zip(*values, strict=True)))
    if isinstance(first, (tuple, list)):
        return type(first)(combine(field) for field in zip(*values, strict=True))
    if isinstance(first, Sequence):  # any other (a range): its type if it takes a list
        fields = [combine(field) for field in zip(*values, strict=True)]
        try:
            return type(first)(fields)  # type: ignore[call-arg]
        except TypeError:
            return fields
    return NotImplemented


def _is_tensor(value: Any) -> bool:
    return type(value).__module__.partition(".")[0] == "torch" and hasattr(value, "detach")


def _tensors(samples: Sequence[Any], allocate: Allocate | None) -> Any:
    """torch tensors, detached (one that requires grad is data here), as arrays without a
    copy; a dtype numpy has not (bfloat16) stays a tensor, stacked by torch."""
    detached = [sample.detach() for sample in samples]
    try:
        arrays = [np.asarray(tensor) for tensor in detached]
    except TypeError:  # no numpy dtype for it
        import torch

        return torch.stack(detached)
    return default_collate(arrays, allocate)


def scalar_dtype(value: Any) -> np.dtype[Any] | None:
    """The dtype a batch of these scalars gets, as torch does; None if not a scalar."""
    if isinstance(value, np.generic):
        return value.dtype
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    if isinstance(value, float):
        return np.dtype(np.float64)
    return None


def check_same_shapes(arrays: Sequence[np.ndarray[Any, Any]]) -> None:
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(
            f"cannot stack arrays of different shapes {sorted(shapes)}; "
            "resize in decode or pass collate="
        )
