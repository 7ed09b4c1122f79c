"""Writes golden.rec / golden.idx with MXNet itself; run by hand where MXNet 1.9 is installed:

    python -m venv /tmp/mx && /tmp/mx/bin/pip install 'numpy<1.24' mxnet==1.9.1
    /tmp/mx/bin/python tests/data/make_mxnet_golden.py

The files are committed; the tests check aioloader's writer and reader against them.
"""

import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent))

from mxnet import recordio  # noqa: E402
from recordio_cases import IMAGE_HEADERS, payloads  # noqa: E402

records = payloads() + [recordio.pack(recordio.IRHeader(*h), p) for h, p in IMAGE_HEADERS]
writer = recordio.MXIndexedRecordIO(str(here / "golden.idx"), str(here / "golden.rec"), "w")
for i, record in enumerate(records):
    writer.write_idx(i, record)
writer.close()
print(f"wrote {len(records)} records")
