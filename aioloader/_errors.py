"""The errors a loader raises, under one base class: `except aioloader.LoaderError`.

Messages are one or two lines; a traceback from a decode process is kept as the error's cause
(`RemoteTraceback`), as `concurrent.futures` does, so it prints below the error.
"""

from __future__ import annotations

from typing import Any


class LoaderError(Exception):
    """Something went wrong producing a batch; the message names the sample and the cause."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as it is (type, message, attributes), whatever its `__init__` takes: a
        loader service raises it in the training process."""
        return (_rebuilt, (type(self), self.args, dict(vars(self))))


def _rebuilt(kind: type[LoaderError], args: tuple[Any, ...], attributes: dict[str, Any]
             ) -> LoaderError:
    error = kind.__new__(kind)
    error.args = args
    vars(error).update(attributes)
    return error


class RemoteTraceback(Exception):
    """The traceback of an error raised in a decode process (the cause of the error raised
    here)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


class FetchError(LoaderError):
    """Reading bytes failed for good: a 4xx status, or the retry budget was spent."""

    def __init__(self, url: str, reason: str, status: int | None = None) -> None:
        self.url = url
        self.status = status
        self.reason = reason
        status_text = f"HTTP {status} " if status is not None else ""
        super().__init__(f"reading {url} failed: {status_text}{reason}")


class SampleError(LoaderError):
    """Fetching or decoding one sample failed; names its index, its key and the cause."""

    def __init__(self, index: int, key: str, stage: str, reason: str) -> None:
        self.index = index
        self.key = key
        self.stage = stage
        self.reason = reason
        LoaderError.__init__(self, f"{stage} failed for sample {index} (key {key!r}): {reason}")


class SampleFetchError(SampleError, FetchError):
    """Reading one sample failed: caught by `except FetchError` and by `except SampleError`;
    names the index, the key, the URL and the status."""

    def __init__(self, index: int, key: str, error: FetchError) -> None:
        self.url, self.status = error.url, error.status
        SampleError.__init__(self, index, key, "fetch", str(error))


class WorkerDiedError(LoaderError):
    """A decode process ended abruptly (a signal, the OOM killer, os._exit) more often than
    `max_worker_restarts` allows, or twice on the same samples."""


class DecodeTimeoutError(LoaderError):
    """A decode task ran longer than `decode_timeout`; names the samples and the process."""


class StallError(LoaderError):
    """Nothing was read, decoded or handed over for `stall_timeout` seconds while the loader
    waited; names the stage that holds it."""
