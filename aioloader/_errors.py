"""The errors a loader raises, under one base class: `except aioloader.LoaderError`.

An error of the user's code (a fetch, a decode, worker_init) is also an instance of its own
type (`typed`), and timeouts and dead workers are RuntimeErrors, as DataLoader raises them.

Messages are one or two lines; a traceback from a decode process is kept as the error's cause
(`RemoteTraceback`), as `concurrent.futures` does, so it prints below the error.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar, cast


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


E = TypeVar("E", bound=LoaderError)


def type_name(error: BaseException) -> str:
    """`module:qualname` of an error's type: how it travels from a decode process."""
    return f"{type(error).__module__}:{type(error).__qualname__}"


def named_type(name: str) -> type[Exception] | None:
    """The exception type `type_name` named, if its module is loaded here; never imports."""
    module, _, qualname = name.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, Exception) else None


def typed(base: type[E], original: type[BaseException] | None) -> type[E]:
    """`base` that is also an `original`, the type the user's code raised, as DataLoader
    re-raises a worker's exception with its own type: `except KeyError` catches a KeyError
    raised in decode, and `except aioloader.SampleError` still does too."""
    if (original is None or not issubclass(original, Exception)
            or issubclass(original, LoaderError) or original is Exception):
        return base
    made = _TYPED.get((base, original))
    if made is None:
        try:
            made = _TYPED[base, original] = _typed(base, original)
        except TypeError:  # a type that cannot be a second base
            return base
    return cast(type[E], made)


_TYPED: dict[tuple[type[LoaderError], type[Exception]], type[LoaderError]] = {}


def _typed(base: type[E], original: type[Exception]) -> type[E]:
    def __new__(cls: type[E], *args: Any, **kwargs: Any) -> E:
        error: E = original.__new__(cls)  # not original's arguments: ours
        return error

    def __init__(self: E, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)  # never original's (OSError's reads errno)

    def __reduce__(self: E) -> tuple[Any, ...]:
        return (_rebuilt_typed, (base, original, self.args, dict(vars(self))))

    namespace = {"__new__": __new__, "__init__": __init__, "__str__": BaseException.__str__,
                 "__reduce__": __reduce__, "__module__": base.__module__,
                 "__qualname__": f"{base.__qualname__}[{original.__qualname__}]"}
    return type(f"{base.__name__}[{original.__name__}]", (base, original), namespace)


def _rebuilt_typed(base: type[E], original: type[Exception], args: tuple[Any, ...],
                   attributes: dict[str, Any]) -> LoaderError:
    return _rebuilt(typed(base, original), args, attributes)


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


class WorkerDiedError(LoaderError, RuntimeError):
    """A decode process ended abruptly (a signal, the OOM killer, os._exit) more often than
    `max_worker_restarts` allows, or twice on the same samples."""


class DecodeTimeoutError(LoaderError, RuntimeError):
    """A decode task ran longer than `decode_timeout`; names the samples and the process."""


class StallError(LoaderError, RuntimeError):
    """Nothing was read, decoded or handed over for `stall_timeout` seconds while the loader
    waited; names the stage that holds it."""


class Exhausted(Exception):
    """An iterator read in a decode process (an IterableDataset's copy) has no more items: not
    an error, the end of that worker's share of the epoch."""
