"""aioloader inside DLIO (the engine behind MLPerf Storage) as a data-loader plugin: DLIO runs
its workload, sleeps its compute time per batch and reports its accelerator utilisation; the
batches come from aioloader instead of DLIO's own loader (PyTorch's DataLoader or tf.data).

Written as a DLIO user writes one (DLIO's "Creating a Data Loader Plugin"): a `BaseDataLoader`
whose `read` builds the loader once and whose `next` yields an epoch's batches. The files are
DLIO's own list; the rank and world size are DLIO's MPI communicator's. A decode process reads
each sample as DLIO's reader does (`dlio_sample.py`: decode lives where importing it does not
import DLIO):
- `.npz` (unet3d): the file, `np.load(file)["x"]`, then DLIO's resized image;
- `.tfrecord` (resnet50): a record, by the index DLIO writes beside its data (DALI's
  `tfrecord2idx` format), its `tf.train.Example` parsed.
With several ranks on a node, one `service="node"` serves them all.

    mpirun -np 2 dlio_benchmark workload=unet3d_h100 \
        ++workload.reader.data_loader_classname=dlio_aioloader.AioloaderDataLoader \
        ++workload.reader.data_loader_sampler=index

with this folder on PYTHONPATH (`benchmarks/dlio.py` runs exactly that, next to DLIO's own
loader, and prints both AUs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from dlio_benchmark.common.enumerations import DataLoaderType, DatasetType, FormatType, Shuffle
from dlio_benchmark.data_loader.base_data_loader import BaseDataLoader
from dlio_sample import DlioSample, dlio_example

import aioloader


class AioloaderDataLoader(BaseDataLoader):  # type: ignore[misc]
    def __init__(self, format_type: Any, dataset_type: Any, epoch_number: int) -> None:
        super().__init__(format_type, dataset_type, epoch_number, DataLoaderType.CUSTOM)
        self._loader: aioloader.Loader | None = None

    def read(self) -> None:
        args = self._args
        train = self.dataset_type is DatasetType.TRAIN
        files = args.file_list_train if train else args.file_list_eval
        # mpirun says how many ranks share this node; the node's service counts them
        os.environ.setdefault("LOCAL_WORLD_SIZE",
                              os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        dataset, decode = self._dataset(files, train)
        self._loader = aioloader.Loader(
            dataset, decode=decode,
            batch_size=self.batch_size, drop_last=True,
            shuffle=args.sample_shuffle is not Shuffle.OFF, seed=args.seed,
            num_workers=max(args.read_threads, 1), prefetch=max(args.prefetch_size, 2),
            rank=args.my_rank, world_size=args.comm_size,
            service="node" if args.comm_size > 1 else "process", persistent_workers=True)
        # DLIO times its epochs from here: start the service and decode processes now
        self._loader.start()

    def _dataset(self, files: list[str], train: bool) -> tuple[Any, Any]:
        """The files as aioloader reads them, and the decode of DLIO's reader for the format."""
        if self.format_type is FormatType.TFRECORD:
            # DLIO's generator indexes each file into data_folder/index/{train,valid}
            index = os.path.join(self._args.data_folder, "index", "train" if train else "valid")
            return (aioloader.TFRecord(files, index_urls=[
                os.path.join(index, os.path.basename(name) + ".idx") for name in files]),
                dlio_example)
        return aioloader.Files(files), DlioSample(self._args.resized_image)

    def next(self) -> Iterator[Any]:
        super().next()
        assert self._loader is not None, "read() first"
        yield from self._loader
        self.epoch_number += 1

    def finalize(self) -> None:
        """DLIO calls this after every epoch: the loader, its service and its decode
        processes stay for the next one (they end with the process)."""
