"""The registry from URL scheme to the store that reads it (`_interface.Store`).

A store's module is imported when a URL of its scheme is first read or listed, so that aiohttp
and obstore are imported only by a loader that reads through them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from ._interface import Store
from ._local import local_path
from ._object import AZURE, GCS, S3


@dataclass(frozen=True)
class Scheme:
    """Where the store of a URL scheme lives, and what checks its URLs (cheaply, without
    importing the store's client)."""

    store: str
    """`module:Class`, the module relative to this package."""
    check: Callable[[str], object]
    """Raises ValueError naming the URL for one the store would misread."""


SCHEMES: dict[str, Scheme] = {
    "": Scheme("._local:LocalStore", local_path),
    "file": Scheme("._local:LocalStore", local_path),
    "http": Scheme("._http:HttpStore", lambda url: None),
    "https": Scheme("._http:HttpStore", lambda url: None),
    "s3": Scheme("._object:S3Store", S3.split),
    "gs": Scheme("._object:GCSStore", GCS.split),
    "az": Scheme("._object:AzureStore", AZURE.split),
    "abfs": Scheme("._object:AzureStore", AZURE.split),
    "abfss": Scheme("._object:AzureStore", AZURE.split),
}

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+")
"""A URL scheme as urlsplit takes it; one letter alone is a Windows drive."""
_classes: dict[str, type[Store]] = {}


def scheme_of(url: str) -> str:
    """The URL's scheme, lowercase; "" for a path."""
    scheme = url[:max(url.find(":"), 0)]
    return scheme.lower() if _SCHEME.fullmatch(scheme) else ""


def scheme(url: str) -> Scheme:
    """The registry's entry for the URL, or a ValueError that names the schemes there are."""
    name = scheme_of(url)
    found = SCHEMES.get(name)
    if found is None:
        known = ", ".join(f"{s}://" for s in SCHEMES if s)
        raise ValueError(f"unknown URL scheme {name!r} in {url!r}: use a local path or {known}")
    return found


def check_url(url: str) -> str:
    """Return `url` if a store can read it, else raise a ValueError that says what can, or what
    is wrong with it."""
    scheme(url).check(url)
    return url


def store_class(url: str) -> type[Store]:
    """The class of the store that reads `url`, its module imported on first use."""
    where = scheme(url).store
    found = _classes.get(where)
    if found is None:
        module, _, name = where.partition(":")
        found = _classes[where] = getattr(importlib.import_module(module, __package__), name)
    return found
