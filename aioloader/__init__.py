"""aioloader: an asyncio data loader for training on slow storage.

Many reads in flight from one event loop, decoding in a process pool, collated numpy batches
for `async for`, plain `for` and PyTorch.
"""

from . import storage, vision
from .cache import SharedCache
from .collate import default_collate
from .datasets import Dataset, Files, RecordIO, Stream, StreamBatches, TarShards
from .errors import FetchError, LoaderError, SampleError, WorkerDiedError
from .loader import Loader
from .sampling import ShardInfo, get_shard_info
from .stats import LoaderStats
from .workers import WorkerInfo, get_worker_info

__version__ = "0.1.0"

__all__ = [
    "Dataset",
    "FetchError",
    "Files",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "RecordIO",
    "SampleError",
    "ShardInfo",
    "SharedCache",
    "Stream",
    "StreamBatches",
    "TarShards",
    "WorkerDiedError",
    "WorkerInfo",
    "default_collate",
    "get_shard_info",
    "get_worker_info",
    "storage",
    "vision",
]
