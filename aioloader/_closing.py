"""Context-manager halves shared by everything that owns something to close."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T", bound="Closing")
A = TypeVar("A", bound="AsyncClosing")


class Closing:
    """`with obj:` calls `obj.close()` on the way out."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClosing:
    """`async with obj:` awaits `obj.aclose()` on the way out."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
