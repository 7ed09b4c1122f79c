"""The errors a loader raises, under one base class: `except aioloader.LoaderError`."""

from __future__ import annotations


class LoaderError(Exception):
    """Something went wrong producing a batch; the message names the sample and the cause."""


class FetchError(LoaderError):
    """Reading bytes failed for good: a 4xx status, or the retry budget was spent."""

    def __init__(self, url: str, reason: str, status: int | None = None) -> None:
        self.url = url
        self.status = status
        self.reason = reason
        status_text = f"HTTP {status} " if status is not None else ""
        super().__init__(f"reading {url} failed: {status_text}{reason}")


class SampleError(LoaderError):
    """Fetching or decoding one sample failed; names its index and key, keeps the traceback."""

    def __init__(self, index: int, key: str, stage: str, detail: str) -> None:
        self.index = index
        self.key = key
        self.stage = stage
        self.detail = detail
        super().__init__(f"{stage} failed for sample {index} (key {key!r}):\n{detail}")


class WorkerDiedError(LoaderError):
    """A decode process ended abruptly (a signal, the OOM killer, os._exit)."""
