"""DALI's `tfrecord2idx`, which DLIO calls to index each TFRecord file it generates: a line per
record, its offset and its size, framing included. DLIO's environment here has no DALI, so
`benchmarks/dlio.py` puts this on DLIO's PATH under that name.

    python benchmarks/tfrecord2idx.py FILE.tfrecord FILE.tfrecord.idx
"""

from __future__ import annotations

import sys

from aioloader.tfrecord import HEADER, record_size


def main() -> None:
    data, index = sys.argv[1:3]
    offset = 0
    with open(data, "rb") as records, open(index, "w") as lines:
        while header := records.read(HEADER):
            size = record_size(header, data, offset)
            lines.write(f"{offset} {size}\n")
            offset += size
            records.seek(offset)


if __name__ == "__main__":
    main()
