"""The decode step of the DLIO plugin (`dlio_aioloader.py`), in a module of its own: decode
processes import the module their decode function lives in, and DLIO's modules import
TensorFlow, which would cost each decode process seconds before its first sample."""

from __future__ import annotations

import io
from typing import Any

import numpy as np


class DlioSample:
    """DLIO's NPZ reader, in a decode process: the sample's array read whole, then DLIO's
    resized image (the same for every sample, as DLIO's `read_index` returns)."""

    def __init__(self, image: np.ndarray[Any, Any]) -> None:
        self.image = image

    def __call__(self, raw: bytes) -> np.ndarray[Any, Any]:
        with np.load(io.BytesIO(raw), allow_pickle=True) as archive:
            archive["x"]
        return self.image
