"""What is in a `.rec`, `.tar` or `.tfrecord` file: counts, sizes, labels and the first
records."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .. import recordio, tfrecord
from .._datasets import RecordIO, TarShards, TFRecord
from .._errors import FetchError
from .._loader import Loader
from ..storage._storage import local_path


def summarize(url: str, first: int = 5) -> str:
    """`url`: a local path, file://, http(s):// or s3:// URL of a .rec, a .tar (compressed
    too) or a .tfrecord."""
    path = urlsplit(url).path.lower()
    if path.endswith(TAR_SUFFIXES):
        return _summarize_tar(url, first)
    if path.endswith(".tfrecord"):
        return _summarize_tfrecord(url, first)
    if not path.endswith(".rec"):
        raise ValueError(f"cannot tell the format of {url}: inspect reads .rec, .tar "
                         f"({', '.join(TAR_SUFFIXES[1:])}) and .tfrecord files")
    dataset, index = _open_recordio(url)
    lines = [f"{url}: RecordIO, {'index ' + index if index else 'no index'}"]
    sizes, labels, heads = [], Counter[str](), []
    for n, record in enumerate(Loader(dataset, batch_size=None, num_workers=0, concurrency=256)):
        sizes.append(len(record))
        if len(record) < 24:
            continue
        header, payload = recordio.unpack(record)
        labels[_label_text(header.label)] += 1
        if n < first:
            heads.append(f"  {dataset.key(n)}: {header}, {len(payload)} payload bytes")
    lines += [f"records: {len(sizes)}", _size_line("record bytes", sizes)]
    lines += [*_label_lines(labels), "first records:", *heads]
    return "\n".join(lines)


def _open_recordio(url: str) -> tuple[RecordIO, str | None]:
    """The dataset, with the .idx beside the .rec when there is one (else it is scanned)."""
    index = url[: -len(".rec")] + ".idx" if url.endswith(".rec") else None  # not with ?query
    local = None if index is None else local_path(index)
    if index is None or (local is not None and not Path(local).exists()):
        return RecordIO(url), None
    try:
        return RecordIO(url, index), index
    except FetchError as e:
        if e.url != index or e.status != 404:
            raise
    return RecordIO(url), None


def _summarize_tar(url: str, first: int) -> str:
    shards = TarShards(url)
    lines = [f"{url}: WebDataset tar shard" + (f"s ({len(shards.urls)})" if len(shards.urls) > 1
                                                else "")]
    sizes, labels, extensions, heads = [], Counter[str](), Counter[str](), []
    samples = Loader(shards, batch_size=None, num_workers=0)
    for n, sample in enumerate(samples):
        parts = {k: len(v) for k, v in sample.items() if not k.startswith("__")}
        sizes.append(sum(parts.values()))
        extensions.update(parts.keys())
        label = sample["cls"].decode(errors="replace").strip() if "cls" in sample else None
        if label is not None:
            labels[label] += 1
        if n < first:
            shown = ", ".join(f"{k}: {v} bytes" for k, v in parts.items() if k != "cls")
            heads.append(f"  {sample['__key__']}: {shown}"
                         + ("" if label is None else f", label {label}"))
    lines += [f"samples: {len(sizes)}", _size_line("sample bytes", sizes)]
    lines += ["extensions: " + ", ".join(f"{e} x{c}" for e, c in extensions.most_common())]
    lines += [*_label_lines(labels), "first samples:", *heads]
    return "\n".join(lines)


def _summarize_tfrecord(url: str, first: int) -> str:
    dataset = TFRecord(url)
    lines = [f"{url}: TFRecord"]
    sizes, labels, heads = [], Counter[str](), []
    for n, record in enumerate(Loader(dataset, batch_size=None, num_workers=0)):
        sizes.append(len(record))
        try:
            example = tfrecord.parse_example(record)
        except tfrecord.TFRecordError:
            continue  # not a tf.train.Example: sizes only
        label = next((example[k] for k in LABEL_FEATURES
                      if isinstance(example.get(k), np.ndarray)), None)
        if label is not None:
            labels[_label_text(label)] += 1
        if n < first:
            heads.append(f"  {dataset.key(n)}: " + ", ".join(
                f"{name}: {_feature_text(value)}" for name, value in example.items()))
    lines += [f"records: {len(sizes)}", _size_line("record bytes", sizes)]
    lines += [*_label_lines(labels), "first records (tf.train.Example):", *heads]
    return "\n".join(lines)


TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
LABEL_FEATURES = ("image/class/label", "label")
"""Features a TFRecord's label is found in, as TensorFlow's image datasets name it."""


def _feature_text(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}[{len(value)}]"
    return f"bytes x{len(value)} ({sum(map(len, value))} B)"


def _label_text(label: Any) -> str:
    if isinstance(label, np.ndarray):
        return " ".join(f"{x:g}" for x in label.tolist())
    return f"{label:g}"


def _size_line(what: str, sizes: list[int]) -> str:
    if not sizes:
        return f"{what}: none"
    array = np.asarray(sizes)
    return (
        f"{what}: min {array.min()}, median {int(np.median(array))}, mean {array.mean():.0f}, "
        f"max {array.max()}, total {array.sum() / 1e6:.1f} MB"
    )


def _label_lines(labels: Counter[str], shown: int = 20) -> list[str]:
    if not labels:
        return ["labels: none"]
    counts = ", ".join(f"{label}: {count}" for label, count in labels.most_common(shown))
    more = f" (and {len(labels) - shown} more)" if len(labels) > shown else ""
    return [f"labels ({len(labels)} distinct): {counts}{more}"]
