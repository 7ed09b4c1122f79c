"""`from_torch` for an IterableDataset: each decode process iterates its own copy, as each
DataLoader worker does, and `torch.utils.data.get_worker_info()` there says which worker it is,
so a dataset that shards by worker reads each item once.

A copy resumes as torchdata's StatefulDataLoader resumes a worker's: after each chunk the
process reports where its copy stands (`snapshot`): the items it gave, and the state of the
dataset and of its iterator where they offer `state_dict`. A resumed copy loads the dataset's
state before it iterates and the iterator's after; where neither offers one, it skips the items
it had given."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from .._errors import Exhausted
from .base import Stream

PASSES_KEPT = 16
"""Iterators a process keeps at once: one per pass it serves (a node's ranks each have one)."""


@dataclass
class _Copy:
    """This process's iteration of its copy for one pass."""

    iterator: Iterator[Any]
    yielded: int


class FromTorchIterable(Stream):
    """Never iterated in the event loop: the pass sends each decode process chunks to fill
    from its own iterator (`next_item`), worker by worker in turn. A raw item is the pass's
    ticket, or, in a resumed pass's first chunk for a worker, (ticket, where its copy stood)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._copies: OrderedDict[int, _Copy] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset = state["dataset"]
        self._copies = OrderedDict()

    def __aiter__(self) -> AsyncIterator[Any]:
        raise TypeError("an IterableDataset is iterated in the decode processes, not here")

    def __len__(self) -> int:
        """The dataset's own length, as DataLoader reports it; TypeError if it has none."""
        return len(self.dataset)

    def next_item(self, raw: Any) -> Any:
        """The next item of this process's copy, iterated anew for each pass (its ticket);
        Exhausted at its end."""
        ticket, stood = raw if isinstance(raw, tuple) else (raw, None)
        copy = self._copies.get(ticket)
        if copy is None:
            copy = self._copies[ticket] = self._resumed(stood)
            while len(self._copies) > PASSES_KEPT:
                self._copies.popitem(last=False)
        try:
            item = next(copy.iterator)
        except StopIteration:
            raise Exhausted from None
        copy.yielded += 1
        return item

    def _resumed(self, stood: dict[str, Any] | None) -> _Copy:
        if stood is None:
            return _Copy(iter(self.dataset), 0)
        if stood["dataset"] is not None:
            self.dataset.load_state_dict(stood["dataset"])
        iterator = iter(self.dataset)
        if stood["iterator"] is not None:
            iterator.load_state_dict(stood["iterator"])
        elif stood["dataset"] is None:  # nothing to load: the items given are given again
            for _ in range(stood["yielded"]):
                if next(iterator, _END) is _END:
                    break
        return _Copy(iterator, stood["yielded"])

    def snapshot(self, raw: Any) -> dict[str, Any] | None:
        """Where this process's copy stands after a chunk (named by its first raw item)."""
        copy = self._copies.get(raw[0] if isinstance(raw, tuple) else raw)
        if copy is None:  # its iterator could not be made
            return None
        return {"yielded": copy.yielded, "dataset": _state_of(self.dataset),
                "iterator": _state_of(copy.iterator)}

    def load_in_workers(self) -> tuple[Any, int]:
        return self.next_item, 1

    def key(self, item: Any, position: int) -> str:
        return f"{type(self.dataset).__name__} item {position}"


_END = object()


def _state_of(value: Any) -> Any:
    """`value.state_dict()` where it can also load one (torchdata's Stateful), else None."""
    if callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)):
        return value.state_dict()
    return None
