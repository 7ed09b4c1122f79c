"""Writes hf_*.parquet with Hugging Face `datasets` itself; run by hand where it is installed:

    python -m venv hf && hf/bin/pip install datasets Pillow
    hf/bin/python tests/data/make_hf_parquet.py

The files are committed (datasets is far too heavy a test dependency); the tests check that
aioloader.Parquet reads them as pyarrow does. Made with datasets 5.2, whose to_parquet sets
the compression per column itself (snappy; none for media) and refuses a compression= of ours.
"""

import io
from pathlib import Path

from datasets import ClassLabel, Dataset, Features, Image, List, Value
from PIL import Image as PILImage

here = Path(__file__).resolve().parent
WORDS = ["cat", "dog", "bird", "fish"]

features = Features({
    "text": Value("string"),
    "label": ClassLabel(names=WORDS),
    "scores": List(Value("float32")),
    "tokens": List(Value("string")),
    "meta": {"source": Value("string"), "year": Value("int32")},
    "boxes": List({"x": Value("int16"), "y": Value("int16")}),
    "image": Image(),
})


def png(i: int) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", (4, 3), (i % 256, 0, 255 - i % 256)).save(buffer, "PNG")
    return buffer.getvalue()


def rows(count: int) -> dict[str, list[object]]:
    return {
        "text": [f"sample {i}: " + " ".join(WORDS[: i % 4 + 1]) for i in range(count)],
        "label": [i % 4 for i in range(count)],
        "scores": [[i / 8, -i / 4][: i % 3] for i in range(count)],
        "tokens": [WORDS[i % 4 :] for i in range(count)],
        "meta": [{"source": WORDS[i % 2], "year": 2000 + i} for i in range(count)],
        "boxes": [[{"x": i, "y": -j} for j in range(i % 3)] for i in range(count)],
        "image": [{"bytes": png(i), "path": f"{i}.png"} for i in range(count)],
    }


# several row groups (one per batch of 32 rows); to_parquet compresses with snappy, but
# leaves media columns uncompressed and not dictionary-encoded
Dataset.from_dict(rows(120), features=features).to_parquet(here / "hf_snappy.parquet",
                                                           batch_size=32)
# one row group, types inferred from the values
Dataset.from_dict({
    "id": list(range(50)),
    "question": [f"what is {i} squared?" for i in range(50)],
    "answer": [float(i * i) for i in range(50)],
    "embedding": [[i / 10, i / 20, i / 30] for i in range(50)],
}).to_parquet(here / "hf_single_group.parquet", batch_size=1000)
