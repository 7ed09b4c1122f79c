"""What is in a `.rec` or `.tar` file: counts, sizes, labels and the first records."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .. import recordio
from .._datasets import RecordIO, TarShards
from .._loader import Loader


def summarize(path: Path, first: int = 5) -> str:
    if path.suffix == ".tar":
        return _summarize_tar(path, first)
    index = path.with_suffix(".idx")
    dataset = RecordIO(str(path), str(index) if index.exists() else None)
    lines = [f"{path}: RecordIO, {'index ' + index.name if index.exists() else 'no index'}"]
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


def _summarize_tar(path: Path, first: int) -> str:
    lines = [f"{path}: WebDataset tar shard"]
    sizes, labels, extensions, heads = [], Counter[str](), Counter[str](), []
    samples = Loader(TarShards(str(path)), batch_size=None, num_workers=0)
    for n, sample in enumerate(samples):
        parts = {k: len(v) for k, v in sample.items() if not k.startswith("__")}
        sizes.append(sum(parts.values()))
        extensions.update(parts.keys())
        if "cls" in sample:
            labels[sample["cls"].decode(errors="replace").strip()] += 1
        if n < first:
            heads.append(f"  {sample['__key__']}: {parts}")
    lines += [f"samples: {len(sizes)}", _size_line("sample bytes", sizes)]
    lines += ["extensions: " + ", ".join(f"{e} x{c}" for e, c in extensions.most_common())]
    lines += [*_label_lines(labels), "first samples:", *heads]
    return "\n".join(lines)


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
