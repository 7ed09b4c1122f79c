"""What a `Storage` did, counted by the storage itself; the loader's stats read these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StorageCounters:
    """Running totals of reads; one object may be shared by the storages of many passes."""

    requests: int = 0
    retries: int = 0
    bytes_read: int = 0
    ranges_ignored: int = 0
    """Range requests a server answered with the whole object (200): each read downloaded
    the object up to the range's end."""
    hedges: int = 0
    """Second requests sent for slow reads (at most a budgeted share of reads)."""
    hedge_wins: int = 0
    """Hedges that answered before the read they hedged."""
