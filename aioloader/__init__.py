"""aioloader: an asyncio data loader for training on slow storage.

Many reads in flight from one event loop, decoding in a process pool, collated numpy batches
for `async for`, plain `for` and PyTorch.
"""

from . import storage, vision
from ._cache import SharedCache
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
from ._loader import Loader
from ._runtime.worker import WorkerInfo, get_worker_info
from ._sampling import ShardInfo, get_shard_info
from ._stats import LoaderStats

__version__ = "0.1.0"

__all__ = [
    "Dataset",
    "DecodeTimeoutError",
    "FetchError",
    "Files",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "Mix",
    "Mixed",
    "Parquet",
    "ParquetError",
    "RecordIO",
    "SampleError",
    "ShardInfo",
    "SharedCache",
    "StallError",
    "Stream",
    "StreamBatches",
    "TarShards",
    "WorkerDiedError",
    "WorkerInfo",
    "default_collate",
    "from_torch",
    "get_shard_info",
    "get_worker_info",
    "storage",
    "vision",
]
