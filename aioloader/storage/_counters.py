"""What a `Storage` did, counted by the storage itself; the loader's stats read these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StorageCounters:
    """Running totals of reads; one object may be shared by the storages of many passes."""

    requests: int = 0
    retries: int = 0
    bytes_read: int = 0
