"""Async byte reads by URL: local paths and file://, http(s):// (aiohttp), s3://, gs:// and az://
(obstore); one store per scheme (`_registry`).

Inside a loader's `fetch`, these share the running loader's connection pool, retries and
caches; outside a loader they open a short-lived one. (Imported on first use: decode processes
need the package's counters, not aiohttp.)
"""

import importlib as _importlib
import typing as _typing

__all__ = ["read", "read_range"]

if _typing.TYPE_CHECKING:
    from ._storage import read, read_range


def __getattr__(name: str) -> _typing.Any:
    if name in __all__:
        value = getattr(_importlib.import_module("._storage", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aioloader.storage' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
