"""What a loader service and its client say to each other, framed by `channel.py`: frozen
dataclasses, as the decode channel's messages are.

The client starts with `ServiceInit`; the service answers `Ready` or `Failed`. Then every
message from the client carries `released`, the blocks whose last view died in the trainer
since it last said so. The service's messages of a pass come in order (`Batch`..., then `End`,
`Error` or, after a `Stop`, `Stopped`); `Alive`, `Warned` and `Removed` may come between any
two. `stats` are a pickled snapshot (`_stats.snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._ipc.messages import Environment
from .._sampling import Intervals


@dataclass(frozen=True)
class ServiceInit:
    """The first message a loader service gets: the configuration, pickled, and where the
    training process runs (its import path, environment, working directory). A node's service
    also gets the configuration's fingerprint, which every rank it serves must share, and the
    packages to import before forking decode processes."""

    code: bytes
    environment: Environment
    fingerprint: str = ""
    packages: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Failed:
    """The service could not be set up: why, and where (a traceback, or "")."""

    reason: str
    traceback: str


# -- the client's -------------------------------------------------------------------------


@dataclass(frozen=True)
class Open:
    """Start a pass. Each pass's decode processes see the trainer as it is when it starts;
    `ahead`: batches that may be sent before the trainer takes them."""

    released: list[str]
    epoch: int
    start: int
    remaining: Intervals | None
    copies: dict[str, Any] | None
    ahead: int
    environment: Environment


@dataclass(frozen=True)
class Take:
    """One batch more may be sent."""

    released: list[str]


@dataclass(frozen=True)
class Waiting:
    """The trainer waits, having received `received` batches of the pass: the next may be
    decoded past the memory limit."""

    released: list[str]
    received: int


@dataclass(frozen=True)
class Stop:
    """End the pass early."""

    released: list[str]


@dataclass(frozen=True)
class AskStats:
    released: list[str]


@dataclass(frozen=True)
class Prepare:
    """Start the decode processes a pass of `epoch` would use (`Loader.start`); answered
    with `Prepared` once they are ready."""

    released: list[str]
    epoch: int


ClientMessage = Open | Take | Waiting | Stop | AskStats | Prepare


# -- the service's ------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """`item` (its arrays `Exported` when they are in a block); `position`: where the pass
    stands once it is handed over."""

    item: Any
    position: int
    copies: dict[str, Any] | None = None
    """An IterableDataset's: where each worker's copy stands (`IterableSource.copies`)."""


@dataclass(frozen=True)
class End:
    stats: bytes


@dataclass(frozen=True)
class Error:
    """A batch or the pass failed: the error as it can travel, and the text of its cause.
    Not `final`: one batch failed, and the pass goes on (the client sends a `Take` for it)."""

    error: BaseException
    cause: str
    stats: bytes
    final: bool = True


@dataclass(frozen=True)
class Stopped:
    stats: bytes


PassMessage = Batch | End | Error | Stopped
"""The messages of a pass, in order."""


@dataclass(frozen=True)
class Stats:
    stats: bytes


@dataclass(frozen=True)
class Prepared:
    pass


@dataclass(frozen=True)
class Warned:
    category: type[Warning]
    message: str


@dataclass(frozen=True)
class Removed:
    """Blocks the service let go of: stop mapping them."""

    names: list[str]


@dataclass(frozen=True)
class Alive:
    """The heartbeat, every `HEARTBEAT_SECONDS`."""
