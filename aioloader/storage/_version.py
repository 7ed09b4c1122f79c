"""What a resumed stream checks: that it reads on in the object it began with.

A stream resumes a broken connection from the byte where it stopped. Had the object been
replaced in between, the stream would splice the end of the new one onto the start of the old
one, and a tar shard or .rec file made of two would parse, wrongly, without an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import FetchError


@dataclass(frozen=True)
class Version:
    """The validators and total size the first answer gave (None: not given)."""

    etag: str | None
    last_modified: str | None
    size: int | None

    def check(self, url: str, now: Version, position: int) -> None:
        """Raise FetchError when a resumed answer describes another object: another ETag (or,
        without one, another Last-Modified), or another size when both are known."""
        if self.etag is not None:
            same = now.etag == self.etag
        else:
            same = self.last_modified is None or now.last_modified == self.last_modified
        same_size = self.size is None or now.size is None or now.size == self.size
        if not (same and same_size):
            raise changed(url, position, f"it began as {self}, it is now {now}")

    def __str__(self) -> str:
        parts = [f"ETag {self.etag}" if self.etag is not None else "",
                 f"Last-Modified {self.last_modified}" if self.last_modified is not None else "",
                 f"{self.size} bytes" if self.size is not None else ""]
        return ", ".join(part for part in parts if part) or "unlabelled"


def changed(url: str, position: int, how: str) -> FetchError:
    """The error for an object replaced while a stream read it; not retried: reading on would
    mix two versions."""
    return FetchError(url, f"the object changed during the read (resuming at byte {position}): "
                           f"{how}")
