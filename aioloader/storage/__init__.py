"""Async byte reads by URL: local paths and file://, http(s):// (aiohttp), s3:// (obstore).

Inside a loader's `fetch`, these share the running loader's connection pool, retries and
caches; outside a loader they open a short-lived one.
"""

from ._storage import read, read_range

__all__ = ["read", "read_range"]
