"""Payloads for the RecordIO byte-compatibility tests; also used to make the MXNet golden files.

Kept free of aioloader imports so that `tests/data/make_mxnet_golden.py` runs where only MXNet
is installed.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = struct.pack("<I", 0xCED7230A)


def payloads() -> list[bytes]:
    noise = bytearray(np.random.default_rng(7).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    noise[100:104] = MAGIC
    noise[500:504] = MAGIC
    noise[601:605] = MAGIC  # unaligned: stays in the payload
    return [
        b"",
        b"a",
        b"ab",
        b"abc",
        b"abcd",
        b"abcde",
        MAGIC + b"xyz",
        b"1234" + MAGIC + b"tail",
        b"12" + MAGIC + b"tail!",
        b"1234" + MAGIC,
        MAGIC + MAGIC,
        b"12345" + MAGIC,
        b"abcd" + MAGIC + b"efgh" + MAGIC + b"x",
        bytes(noise),
    ]


IMAGE_HEADERS = [((0, 14.0, 20129312, 0), b"jpegbytes"), ((0, [1.0, 2.5, 3.0], 7, 9), b"payload")]
