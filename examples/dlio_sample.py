"""The decode step of the DLIO plugin (`dlio_aioloader.py`), in a module of its own: decode
processes import the module their decode function lives in, and DLIO's modules import
TensorFlow, which would cost each decode process seconds before its first sample."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from aioloader.tfrecord import parse_example


class DlioSample:
    """DLIO's NPZ reader, in a decode process: the sample's array read whole, then DLIO's
    resized image (the same for every sample, as DLIO's `read_index` returns)."""

    def __init__(self, image: np.ndarray[Any, Any]) -> None:
        self.image = image

    def __call__(self, raw: bytes) -> np.ndarray[Any, Any]:
        with np.load(io.BytesIO(raw), allow_pickle=True) as archive:
            archive["x"]
        return self.image


def dlio_example(raw: bytes) -> int:
    """DLIO's TFRecord reader, in a decode process: the record's `tf.train.Example` parsed
    (its `image` bytes and `size`), as DLIO's `tf.io.parse_example` does. DLIO's reader then
    hands over one resized image per batch, whatever the batch held; this gives the `size`,
    so a batch stays as small."""
    return int(parse_example(raw)["size"][0])
