"""default_collate batches like torch's default_collate, with numpy arrays."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import numpy as np
import pytest

from aioloader import default_collate
from aioloader._collate import concatenate

Point = namedtuple("Point", "x y")


def test_arrays_stack_along_a_new_axis() -> None:
    batch = default_collate([np.zeros((2, 3), np.uint8), np.ones((2, 3), np.uint8)])
    assert batch.shape == (2, 2, 3) and batch.dtype == np.uint8


def test_python_scalars_become_int64_float64_bool() -> None:
    assert default_collate([1, 2]).dtype == np.int64
    assert default_collate([1.0, 2.5]).dtype == np.float64
    assert default_collate([True, False]).dtype == np.bool_
    assert default_collate([np.float32(1), np.float32(2)]).dtype == np.float32


def test_strings_and_bytes_stay_lists_as_in_torch() -> None:
    assert default_collate(["a", "b"]) == ["a", "b"]
    assert default_collate([b"a", b"b\x00"]) == [b"a", b"b\x00"]


def test_nested_dicts_tuples_lists_and_namedtuples() -> None:
    samples = [
        {"image": np.full(2, i), "meta": (i, {"name": f"s{i}"}), "pt": Point(i, 2.0 * i), "l": [i]}
        for i in range(3)
    ]
    batch = default_collate(samples)
    assert batch["image"].tolist() == [[0, 0], [1, 1], [2, 2]]
    ids, meta = batch["meta"]
    assert ids.tolist() == [0, 1, 2] and meta["name"] == ["s0", "s1", "s2"]
    assert isinstance(batch["pt"], Point) and batch["pt"].y.tolist() == [0.0, 2.0, 4.0]
    assert isinstance(batch["l"], list) and batch["l"][0].tolist() == [0, 1, 2]


def test_matches_torch_default_collate_values() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import default_collate as torch_collate

    samples = [{"x": np.arange(4, dtype=np.float32) * i, "y": i, "z": float(i)} for i in range(5)]
    ours, theirs = default_collate(samples), torch_collate(samples)
    for key in samples[0]:
        assert np.asarray(ours[key]).tolist() == theirs[key].tolist()
        assert str(theirs[key].dtype).removeprefix("torch.") == str(np.asarray(ours[key]).dtype)
    assert torch.is_tensor(theirs["x"])


def test_mismatched_shapes_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="different shapes"):
        default_collate([np.zeros(2), np.zeros(3)])


def test_mixed_scalar_dtypes_are_promoted_not_cast_to_the_first() -> None:
    batch = default_collate([np.int64(1), np.float32(0.5)])
    assert batch.dtype.kind == "f" and batch.tolist() == [1.0, 0.5]


def _same(a: Any, b: Any) -> bool:
    """Equal values, types and dtypes, all the way down."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("cuts", [[1], [2], [1, 3], [1, 2, 3, 4]])
def test_batches_of_consecutive_parts_join_into_the_batch_of_the_whole(cuts: list[int]) -> None:
    """The first batch of a pass is collated in parts by several decode processes and joined:
    the same values, types and dtypes as one collate of all its samples."""
    samples = [
        {"image": np.full((2, 2), i, np.uint8), "meta": (i, {"name": f"s{i}", "raw": b"x" * i}),
         "pt": Point(i, 2.0 * i if i % 2 else 2 * i), "l": [True, np.float32(i)], "s": "abc"}
        for i in range(5)
    ]
    parts = [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)], strict=True)]
    joined = concatenate([default_collate(part) for part in parts])
    assert _same(joined, default_collate(samples))


def test_joined_parts_of_different_shapes_fail_as_one_collate_would() -> None:
    with pytest.raises(ValueError, match="different shapes"):
        concatenate([default_collate([np.zeros(2)]), default_collate([np.zeros(3)])])


def test_any_sequence_collates_by_position_as_in_torch() -> None:
    assert [field.tolist() for field in default_collate([range(3), range(3)])] == [
        [0, 0], [1, 1], [2, 2]]


def test_numpy_text_is_text_and_arrays_of_text_or_objects_are_refused_as_in_torch() -> None:
    assert default_collate([np.str_("a"), np.str_("b")]) == ["a", "b"]
    texts = np.array(["a", "b", "c"])
    assert default_collate(texts) is texts  # a batch that is an array of text: as it is
    assert default_collate(np.array([1, 2, 3])).tolist() == [1, 2, 3]
    for refused in (np.array([[["a", "b"]]]), np.array([[[object(), object()]]])):
        with pytest.raises(TypeError, match="found an array of"):
            default_collate(refused)
