"""Passes built from a configuration: what a Loader, a loader service and a node's service all
call, so that none of them reaches into another's members.

`PassFactory(config, ...)` holds what outlives one pass (the decode pool when workers persist,
the shared blocks, a decode backend, the hedger's knowledge of read times, the stats) and
`build(epoch, start, remaining)` wires a new pass from it: storage, read limit, source, decoder,
blocks and shard info. Who runs the pass, and where it stands in the epochs, is the caller's.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol, cast

import numpy as np

from .._closing import ProcessBound
from .._collate import default_collate
from .._config import LoaderConfig
from .._datasets import Dataset, Stream
from .._datasets.torchiter import FromTorchIterable
from .._errors import LoaderError
from .._ipc import shm
from .._ipc.transport import BlockPool
from .._processes.pool import DecodePool
from .._processes.zygote import START_TIMEOUT
from .._sampling import EpochPlan, Intervals, ShardInfo, Spawn, call_with_shard_info
from .._scheduling.decoders import Decoder, InlineDecoder, PoolDecoder, Recovery
from .._scheduling.remote import BackendHolder, RemoteDecoder
from .._stats import LoaderStats
from .._worker.decode import DecodeSpec
from ..storage._counters import StorageCounters
from ..storage._diskcache import DiskCache
from ..storage._hedge import Hedger
from ..storage._storage import Storage
from . import autotune
from .budget import MemoryBudget, ReadAhead
from .feeds import IterableSource, PlannedSource, StreamSource
from .pipeline import Pass, PassConfig

UNBATCHED_CHUNK = 16
"""Samples per decode task when batch_size is None: amortises the pipe without hurting latency."""
READ_AHEAD_PER_READ = 32
"""Samples read ahead of the decode stage per read in flight (bounded by memory_limit too)."""


class Share(Protocol):
    """What a node's loader service shares among its ranks' passes
    (`_service.node_server.NodeShare`)."""

    reads: autotune.ReadLimit
    storage: Storage
    blocks: BlockPool | None
    disk_cache: DiskCache | None
    counters: StorageCounters
    budget: MemoryBudget
    """The node's memory limit, one account for every rank's passes."""
    ranks: int

    def decoder(self) -> Decoder: ...

    def start_decoding(self) -> None: ...


class PassFactory:
    """Builds passes of one configuration and owns what they share from pass to pass.

    `executor`: a decode backend (a `concurrent.futures.Executor`, a Dask client, "ray").
    `export`: batches go to another process (a service's client), not into views here.
    `share`: a node's reads, storage, decode processes and blocks, for one of its ranks.
    """

    def __init__(self, config: LoaderConfig, executor: object = None, export: bool = False,
                 share: Share | None = None) -> None:
        self.config = config
        self.share = share
        dataset = config.dataset
        if (isinstance(dataset, Dataset) and config.num_workers
                and (executor is None or isinstance(executor, Executor))):
            dataset = dataset.for_local_decode() or dataset
        self.dataset = dataset
        """The data as the passes read it (large objects: read in the decode processes, or
        into shared memory for them)."""
        if config.cache is not None:
            config.cache.attach(len(cast(Dataset, dataset)))
        self.concurrency = config.concurrency
        """Reads allowed in flight now: `config.concurrency`, or what tuning chose."""
        self.stats = LoaderStats()
        self._hedger = Hedger(self.stats.storage) if config.hedge else None
        """Kept from pass to pass: what it learnt of read times is valid in the next epoch."""
        self.disk_cache: DiskCache | None = None
        if share is not None:
            self.disk_cache, self.stats.storage = share.disk_cache, share.counters
        elif config.cache_dir is not None:
            self.disk_cache = DiskCache(config.cache_dir, config.cache_limit)
        self.stats.cache_reports = [c.report for c in (config.cache, self.disk_cache)
                                    if c is not None]
        self.stats.source_shares = getattr(dataset, "shares", None)
        self.executor = executor
        load, threads = (dataset.load_in_workers() if isinstance(dataset, FromTorchIterable)
                         else (None, 1) if isinstance(dataset, Stream)
                         else dataset.load_in_workers() or (None, 1))
        self.stats.load_threads = threads if load is not None and dataset is config.dataset else 0
        self.stats.read_in_decode = isinstance(dataset, Dataset) and dataset.reads_in_decode
        self.spec = DecodeSpec(
            config.decode, config.collate if config.batch_size else None, config.skip_errors,
            config.seed, config.augment, config.cache, load, threads,
            load_reads=self.stats.read_in_decode,
            drop_partial=(isinstance(dataset, FromTorchIterable) and config.drop_last
                          and config.batch_size is not None),
            snapshot=dataset.snapshot if isinstance(dataset, FromTorchIterable) else None,
        )
        self.backend: BackendHolder | None = None
        if executor is not None:
            self.backend = BackendHolder(executor, self.spec, max(config.num_workers, 1))
        self.pools = PoolHolder()
        self.blocks: BlockPool | None = None
        if share is not None:
            self.blocks = share.blocks
        elif (config.shared_memory and config.num_workers and executor is None
                and config.service is None and shm.available()):
            self.blocks = BlockPool(max_blocks=self.blocks_per_pass(),
                                    max_idle=config.memory_limit, export=export)
        self.budget = (share.budget if share is not None
                       else MemoryBudget(config.memory_limit, self.blocks))

    # -- sizes -------------------------------------------------------------------------------

    def shard_info(self, epoch: int, remaining: Intervals | None = None) -> ShardInfo:
        config = self.config
        ranks = self.share.ranks if self.share is not None else 1  # a node: a share each
        return ShardInfo(config.rank, config.world_size, epoch, config.seed, config.shuffle,
                         config.drop_last, remaining, config.memory_limit // 2 // ranks,
                         ReadAhead(self.budget),
                         (config.batch_size or 1) * self.steps_per_chunk())

    def steps_per_chunk(self) -> int:
        return 1 if self.config.batch_size else UNBATCHED_CHUNK

    def _prefetch_chunks(self) -> int:
        return -(-self.config.prefetch // self.steps_per_chunk())

    def blocks_per_pass(self) -> int:
        """Shared blocks a pass may use at once: its decode window and prefetch, and a few
        being released."""
        return self._decode_window() + self._prefetch_chunks() + 4

    def _decode_window(self) -> int:
        """Chunks decoding or finished and waiting: enough for every decode process to have
        one running and one queued, plus the prefetch."""
        return self._prefetch_chunks() + 2 * max(self.config.num_workers, 1) + 1

    def new_storage(self, connections: int) -> Storage:
        """Storage as this configuration reads: its retries, timeout, counters, disk cache,
        size bound and hedger."""
        config = self.config
        return Storage(connections, config.retries, config.timeout, self.stats.storage,
                       self.disk_cache, config.max_object_bytes, self._hedger or False)

    def pass_config(self, epoch: int) -> PassConfig:
        config = self.config
        chunk_samples = (config.batch_size or 1) * self.steps_per_chunk()
        reads = autotune.HIGHEST if config.auto_concurrency else self.concurrency
        if self.share is not None:  # the node's reads, shared among its ranks
            reads = max(1, reads // self.share.ranks)
        return PassConfig(
            epoch=epoch,
            batch_size=config.batch_size,
            steps_per_chunk=self.steps_per_chunk(),
            ordered=config.ordered,
            skip_errors=config.skip_errors,
            memory_limit=config.memory_limit,
            read_ahead=max(READ_AHEAD_PER_READ * reads, 2 * chunk_samples),
            decode_window=self._decode_window(),
            stall_timeout=config.stall_timeout,
            first_chunk_parts=self._first_chunk_parts(),
            start_chunks=max(config.num_workers, 1) + 1,
            row_by_row=self.spec.collate is default_collate,
        )

    def _first_chunk_parts(self) -> int:
        """Decode processes a pass's first batch is divided among: all of them, when there are
        several and the batch is made by the default collate (which can be joined)."""
        workers = self.config.num_workers
        divisible = (self.config.batch_size and self.executor is None and workers > 1
                     and self.spec.collate is default_collate and not self.nothing_to_decode()
                     and not isinstance(self.config.dataset, FromTorchIterable))  # per worker
        return workers if divisible else 1

    # -- a pass ------------------------------------------------------------------------------

    async def open(self, epoch: int, start: int, remaining: Intervals | None,
                   copies: dict[str, Any] | None = None) -> Pass:
        """A started pass over `epoch` from `start` (streams divided by samples: over
        `remaining`; an IterableDataset: its copies where `copies` says), built in the running
        loop."""
        running = self.build(epoch, start, remaining, copies)
        try:
            await running.start()
        except BaseException:
            await running.aclose()
            raise
        return running

    def build(self, epoch: int, start: int, remaining: Intervals | None,
              copies: dict[str, Any] | None = None) -> Pass:
        config, stats, share, dataset = self.config, self.stats, self.share, self.dataset
        pass_config = self.pass_config(epoch)
        # a stream is pulled one item at a time, whatever it reads ahead itself
        stats.concurrency = 1 if isinstance(dataset, Stream) else self.concurrency
        stats.stream = isinstance(dataset, Stream)
        stats.decode_processes = config.num_workers
        if share is not None:  # the node's, for every rank's passes
            reads, storage = share.reads, share.storage
        else:
            reads = autotune.ReadLimit(self.concurrency)
            connections = autotune.HIGHEST if config.auto_concurrency else self.concurrency
            storage = self.new_storage(connections)
        source: PlannedSource | StreamSource | IterableSource
        if isinstance(dataset, FromTorchIterable):
            source = IterableSource(dataset, max(config.num_workers, 1),
                                    config.batch_size or 1, pass_config.steps_per_chunk,
                                    start, copies)
        elif isinstance(dataset, Stream):
            source = StreamSource(
                dataset, start, config.batch_size or 1, pass_config.steps_per_chunk,
                not (config.drop_last and config.batch_size), stats,
            )
        else:
            order = dataset.epoch_order(config.shuffle, config.seed, epoch)
            plan = EpochPlan(order, config.batch_size or 1, config.rank, config.world_size,
                             config.drop_last, start)
            source = PlannedSource(dataset, plan, pass_config.steps_per_chunk,
                                   config.skip_errors, config.cache, reads, stats)
        decoder: Decoder = self.decoder(epoch) if share is None else share.decoder()
        blocks = self.blocks
        if isinstance(decoder, InlineDecoder) and blocks is not None and not blocks.export:
            blocks = None  # collated here and used here: no block to copy the batch into
        side_tasks = []
        if config.auto_concurrency and share is None:  # a node's reads stay as set
            tuner = autotune.Tuner(
                reads,
                lambda: (stats.fetch.count, stats.fetch.total, stats.consumer_wait.total),
                self._use_concurrency,
            )
            side_tasks.append(tuner.tune())
        info = self.shard_info(epoch, remaining)

        def in_context(start_task: Callable[[], asyncio.Task[None]]) -> asyncio.Task[None]:
            """The feed and the tasks it starts see this pass's storage and shard info."""

            def start_with_storage() -> asyncio.Task[None]:
                with storage.as_current():
                    return start_task()

            return call_with_shard_info(info, start_with_storage)

        return Pass(pass_config, source, decoder, blocks, stats, storage, in_context,
                    side_tasks, owns_storage=share is None, budget=self.budget)

    def decoder(self, epoch: int) -> Decoder:
        """A pass's decoder: on the backend, inline, or on decode processes (the persistent
        pool, or a pool of the pass's own)."""
        config = self.config
        if self.backend is not None:
            return RemoteDecoder(self.backend.backend, self._recovery())
        if not self._decodes_in_processes():
            return InlineDecoder(self.spec)
        base_seed = self._worker_seed(epoch)

        def get_pool() -> DecodePool:
            if config.persistent_workers:
                return self.pools.get(self.spec, config, base_seed)
            return DecodePool(self.spec, config.num_workers, base_seed, config.worker_init)

        return PoolDecoder(get_pool, not config.persistent_workers, self._recovery())

    def start_decoding(self, epoch: int) -> None:
        """Start now the decode processes a pass of `epoch` would start, when they persist from
        pass to pass (a node's: every rank's), and wait until each said it is ready or ended:
        what failed to start is reported by the first pass, as without this. Blocking."""
        config = self.config
        if self.share is not None:
            self.share.start_decoding()
        elif config.persistent_workers and self.backend is None and self._decodes_in_processes():
            self.pools.get(self.spec, config, self._worker_seed(epoch)).wait_settled(
                START_TIMEOUT)

    def _decodes_in_processes(self) -> bool:
        """Without a backend: whether passes decode in processes (else inline, here)."""
        return bool(self.config.num_workers) and not self.nothing_to_decode()

    def _worker_seed(self, epoch: int) -> int:
        return int(
            np.random.SeedSequence([self.config.seed, epoch], spawn_key=(Spawn.WORKER_SEEDS,))
            .generate_state(1)[0]
        )

    def _recovery(self) -> Recovery:
        config = self.config
        return Recovery(config.decode_timeout, config.max_worker_restarts, config.skip_errors,
                        self._worker_restarted, self._decode_timed_out)

    def nothing_to_decode(self) -> bool:
        """No decode, no augment, no cache, nothing read in the workers, the default collate
        and no worker_init: sending raw items to a process and back would cost more than
        collating them here."""
        spec = self.spec
        return (spec.passes_through and spec.collate in (None, default_collate)
                and self.config.worker_init is None)

    def _use_concurrency(self, limit: int) -> None:
        self.concurrency = self.stats.concurrency = limit

    def _decode_timed_out(self) -> None:
        self.stats.decode_timeouts += 1

    def _worker_restarted(self, message: str) -> None:
        self.stats.worker_restarts += 1
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Processes first: none may create a block after the blocks are removed. A node's
        blocks are the node's. Idempotent; in a forked child only the child's copies go."""
        self.pools.close()
        if self.backend is not None:
            self.backend.close()
        if self.blocks is not None and self.share is None:
            self.blocks.close()


class PoolHolder(ProcessBound):
    """The persistent decode pool, built on first use; apart from the factory so that a
    finalizer can close it."""

    def __init__(self) -> None:
        super().__init__()
        self._pool: DecodePool | None = None
        self._lock = threading.Lock()

    def check_process(self) -> None:
        """LoaderError in a child forked from the loader's process: what it would use is the
        parent's."""
        if self.foreign:
            raise LoaderError(
                f"this Loader was built in process {self.owner_pid}, and process {os.getpid()} "
                "is a child forked from it: its decode processes and shared memory are the "
                "parent's. Build a new Loader in the child."
            )

    def get(self, spec: DecodeSpec, config: LoaderConfig, base_seed: int) -> DecodePool:
        self.check_process()
        with self._lock:
            if self._pool is None:
                self._pool = DecodePool(spec, config.num_workers, base_seed, config.worker_init)
            return self._pool

    def close(self) -> None:
        if self.foreign:  # no lock: a thread of the parent may have held it at the fork
            pool, self._pool = self._pool, None
        else:
            with self._lock:
                pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
