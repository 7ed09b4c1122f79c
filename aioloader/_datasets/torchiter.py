"""`from_torch` for an IterableDataset: each decode process iterates its own copy, as each
DataLoader worker does, and `torch.utils.data.get_worker_info()` there says which worker it is,
so a dataset that shards by worker reads each item once."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from .._errors import Exhausted
from .base import Stream

PASSES_KEPT = 16
"""Iterators a process keeps at once: one per pass it serves (a node's ranks each have one)."""


class FromTorchIterable(Stream):
    """Never iterated in the event loop: the pass sends each decode process chunks to fill
    from its own iterator (`next_item`), worker by worker in turn."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._iterators: OrderedDict[int, Iterator[Any]] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"dataset": self.dataset}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset = state["dataset"]
        self._iterators = OrderedDict()

    def __aiter__(self) -> AsyncIterator[Any]:
        raise TypeError("an IterableDataset is iterated in the decode processes, not here")

    def __len__(self) -> int:
        """The dataset's own length, as DataLoader reports it; TypeError if it has none."""
        return len(self.dataset)

    def next_item(self, ticket: int) -> Any:
        """The next item of this process's copy, iterated anew for each pass (`ticket`);
        Exhausted at its end."""
        iterator = self._iterators.get(ticket)
        if iterator is None:
            iterator = self._iterators[ticket] = iter(self.dataset)
            while len(self._iterators) > PASSES_KEPT:
                self._iterators.popitem(last=False)
        try:
            return next(iterator)
        except StopIteration:
            raise Exhausted from None

    def load_in_workers(self) -> tuple[Any, int]:
        return self.next_item, 1

    def key(self, item: Any, position: int) -> str:
        return f"{type(self.dataset).__name__} item {position}"
