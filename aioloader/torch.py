"""The PyTorch bridge: batches as tensors, and an IterableDataset for code that wants one.

torch is imported here only; `import aioloader` never imports it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    import torch
    import torch.utils.data
except ImportError as e:
    raise ImportError(
        f"PyTorch is needed for aioloader.torch: pip install 'aioloader[torch]' ({e})"
    ) from None

from ._closing import Closing
from ._ipc.transport import map_arrays
from ._loader import Loader

__all__ = ["TorchLoader", "as_iterable_dataset", "to_tensors"]


def to_tensors(batch: Any, pin_memory: bool = False) -> Any:
    """The same structure with every numpy array turned into a tensor sharing its memory."""

    def tensor(array: np.ndarray[Any, Any]) -> Any:
        if array.dtype.kind in "USO":  # strings and objects have no tensor type
            return array
        converted = torch.from_numpy(array)
        return converted.pin_memory() if pin_memory else converted

    return map_arrays(batch, tensor)


def _can_pin() -> bool:
    return bool(torch.cuda.is_available())


class TorchLoader(Closing):
    """Iterates a Loader with numpy arrays turned into tensors (`torch.from_numpy`, no copy)."""

    def __init__(self, loader: Loader, pin_memory: bool = False) -> None:
        self.loader = loader
        self.pin_memory = pin_memory and _can_pin()
        if pin_memory and not self.pin_memory:
            warnings.warn(
                "pin_memory=True but no accelerator is available; batches stay in pageable memory",
                stacklevel=2,
            )

    def __iter__(self) -> Iterator[Any]:
        return _Tensors(iter(self.loader), self.pin_memory)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: batches handed over as tensors count as handed over."""
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


class _Tensors:
    """A pass's batches as tensors. An iterator, not a generator: a generator ends at its first
    raise, and after a batch's error the next `next()` must go on, as with DataLoader."""

    def __init__(self, batches: Iterator[Any], pin_memory: bool) -> None:
        self._batches = batches
        self._pin_memory = pin_memory

    def __iter__(self) -> _Tensors:
        return self

    def __next__(self) -> Any:
        return to_tensors(next(self._batches), self._pin_memory)

    def close(self) -> None:
        """Ends the pass now, as a `break` does."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class _LoaderDataset(torch.utils.data.IterableDataset[Any]):
    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "an aioloader dataset runs its own workers: wrap it in "
                "DataLoader(ds, batch_size=None, num_workers=0)"
            )
        return iter(TorchLoader(self.loader))

    def __len__(self) -> int:
        return len(self.loader)


def as_iterable_dataset(loader: Loader) -> torch.utils.data.IterableDataset[Any]:
    """For frameworks that insist on a DataLoader: use `DataLoader(ds, batch_size=None)`."""
    return _LoaderDataset(loader)
