"""How many bytes one read may return: a hostile or broken server must not fill memory."""

from __future__ import annotations

from .._errors import FetchError

DEFAULT_MAX_OBJECT_BYTES = 2 << 30
"""2 GiB: room for any sample, record or usual shard; far below a training host's memory."""


def too_large(url: str, limit: int, what: str) -> FetchError:
    """The error for a read past `limit` bytes; not retried: the object will not shrink."""
    return FetchError(
        url, f"{what}: over max_object_bytes={limit} (raise the limit if that size is right)"
    )


def check_range(url: str, start: int | None, end: int | None, limit: int) -> None:
    """Refuse before asking when the range asked for is itself over the limit."""
    if start is not None and end is not None and end - start > limit:
        raise too_large(url, limit, f"the range {start}..{end} has {end - start} bytes")
