"""The timeline picture: one row for the fetch stage, one per decode process, one for the
consumer, a box per sample (fetch, decode) and per batch (the consumer's step, and its waits)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .._stats import Event

COLOURS = {"fetch": "tab:blue", "decode": "tab:orange", "step": "tab:green", "wait": "tab:red"}
LABELS = {"fetch": "reading a sample", "decode": "decoding a sample",
          "step": "consumer works on a batch", "wait": "consumer waits for a batch"}


def draw(events: Iterable[Event], path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"matplotlib is needed to draw the timeline: "
                          f"pip install 'aioloader[plot]' ({e})") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = list(events)
    if not events:
        raise ValueError("no events to draw: iterate the loader first")
    origin = min(e.start for e in events)
    decode_rows = sorted({e.row for e in events} - {"fetch", "consumer"})
    rows = ["consumer", *reversed(decode_rows), "fetch"]
    figure, axes = plt.subplots(figsize=(12, 1.2 + 0.6 * len(rows)))
    for y, row in enumerate(rows):
        for kind in COLOURS:
            boxes = [(e.start - origin, max(e.end - e.start, 1e-4))
                     for e in events if e.row == row and e.kind == kind]
            if boxes:
                axes.broken_barh(boxes, (y - 0.4, 0.8), color=COLOURS[kind],
                                 alpha=0.25 if kind == "fetch" else 0.85, label=LABELS[kind])
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    axes.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes.set_yticks(range(len(rows)), rows)
    axes.set_xlabel("seconds")
    axes.set_title(title, fontsize=9, loc="left")
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
