"""What a sample is and where its bytes lie."""

from .base import Dataset, Stream
from .files import Files
from .mix import Mix, Mixed
from .parquet import Parquet, ParquetError
from .recordio import RecordIO
from .streambatches import StreamBatches
from .tarshards import TarShards
from .tfrecords import TFRecord, TFRecordStream
from .torchmap import from_torch

__all__ = [
    "Dataset",
    "Files",
    "Mix",
    "Mixed",
    "Parquet",
    "ParquetError",
    "RecordIO",
    "Stream",
    "StreamBatches",
    "TFRecord",
    "TFRecordStream",
    "TarShards",
    "from_torch",
]
