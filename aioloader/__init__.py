"""aioloader: an asyncio data loader for training on slow storage.

Many reads in flight from one event loop, decoding in a process pool, collated numpy batches
for `async for`, plain `for` and PyTorch.

Names are imported on first use (PEP 562), so `import aioloader` is quick, and so is the start
of the process that forks decode processes, which needs only a few of them.
"""

import importlib as _importlib
import typing as _typing

__version__ = "0.1.0"

__all__ = [
    "CorruptEntry",
    "Dataset",
    "DecodeTimeoutError",
    "FetchError",
    "Files",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "Mix",
    "Mixed",
    "NotOwned",
    "Parquet",
    "ParquetError",
    "RecordIO",
    "RecordIOError",
    "SampleError",
    "ShardInfo",
    "SharedCache",
    "StallError",
    "Stream",
    "StreamBatches",
    "TFRecord",
    "TFRecordError",
    "TFRecordStream",
    "TarFormatError",
    "TarShards",
    "WorkerDiedError",
    "WorkerInfo",
    "default_collate",
    "from_torch",
    "get_shard_info",
    "get_worker_info",
    "storage",
    "tfrecord",
    "vision",
]

_WHERE = {
    "Dataset": "_datasets",
    "DecodeTimeoutError": "_errors",
    "FetchError": "_errors",
    "Files": "_datasets",
    "Loader": "_loader",
    "LoaderError": "_errors",
    "LoaderStats": "_stats",
    "Mix": "_datasets",
    "Mixed": "_datasets",
    "Parquet": "_datasets",
    "ParquetError": "_datasets",
    "RecordIO": "_datasets",
    "SampleError": "_errors",
    "ShardInfo": "_sampling",
    "SharedCache": "_cache",
    "StallError": "_errors",
    "Stream": "_datasets",
    "StreamBatches": "_datasets",
    "TarShards": "_datasets",
    "TFRecord": "_datasets",
    "TFRecordStream": "_datasets",
    "WorkerDiedError": "_errors",
    "WorkerInfo": "_worker.decode",
    "default_collate": "_collate",
    "CorruptEntry": "_cache",
    "NotOwned": "_ipc.shm",
    "RecordIOError": "recordio",
    "TarFormatError": "_tar",
    "TFRecordError": "tfrecord",
    "from_torch": "_datasets",
    "get_shard_info": "_sampling",
    "get_worker_info": "_worker.decode",
}
_SUBMODULES = {"recordio", "storage", "testing", "tfrecord", "torch", "vision"}

if _typing.TYPE_CHECKING:
    from . import storage, tfrecord, vision
    from ._cache import CorruptEntry, SharedCache
    from ._collate import default_collate
    from ._datasets import (
        Dataset,
        Files,
        Mix,
        Mixed,
        Parquet,
        ParquetError,
        RecordIO,
        Stream,
        StreamBatches,
        TarShards,
        TFRecord,
        TFRecordStream,
        from_torch,
    )
    from ._errors import (
        DecodeTimeoutError,
        FetchError,
        LoaderError,
        SampleError,
        StallError,
        WorkerDiedError,
    )
    from ._ipc.shm import NotOwned
    from ._loader import Loader
    from ._sampling import ShardInfo, get_shard_info
    from ._stats import LoaderStats
    from ._tar import TarFormatError
    from ._worker.decode import WorkerInfo, get_worker_info
    from .recordio import RecordIOError
    from .tfrecord import TFRecordError


def __getattr__(name: str) -> _typing.Any:
    if name in _SUBMODULES:
        value: _typing.Any = _importlib.import_module(f".{name}", __name__)
    elif name in _WHERE:
        value = getattr(_importlib.import_module(f".{_WHERE[name]}", __name__), name)
    else:
        raise AttributeError(f"module 'aioloader' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
