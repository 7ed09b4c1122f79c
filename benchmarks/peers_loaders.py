"""The loaders of benchmarks/peers.py, and the measurement of one of them in a process of its
own (so that no loader inherits another's threads, runtimes or shared memory, and the process
tree measured is that loader's alone).

Every loader reads the bucket through the proxy, runs the same decode-and-augment on the same
JPEG bytes, in 2 processes, in shuffled batches of 64, with persistent workers.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from peers_formats import import_streaming_base
from peers_s3 import PerProcessS3, read_stats

from aioloader._tools.images import decode_and_augment

BATCH = 64
WORKERS = 2


@dataclass
class Plan:
    """What a loader's process is told: where the data is and where its caches go."""

    endpoint: str
    bucket: str
    keys: dict[str, list[str]]
    """Bucket folder -> the keys uploaded there."""
    cache: str
    """This loader's local cache folder (LitData's, Mosaic's): removed before set-up."""
    server_pids: list[int]
    """The proxy's and moto's, whose CPU is measured apart."""
    concurrency: int
    """aioloader's reads in flight."""

    def urls(self, folder: str, suffix: str = "") -> list[str]:
        return [f"s3://{self.bucket}/{k}" for k in self.keys[folder] if k.endswith(suffix)]

    @classmethod
    def load(cls, path: str) -> Plan:
        return cls(**json.loads(Path(path).read_text()))


# --- the one decode, wrapped per format ---

_RNGS: dict[int, np.random.Generator] = {}


def process_rng() -> np.random.Generator:
    """One generator per process, for the peers, which pass no rng of their own."""
    pid = os.getpid()
    if pid not in _RNGS:
        _RNGS[pid] = np.random.default_rng()
    return _RNGS[pid]


def decode(raw: bytes, label: Any) -> dict[str, Any]:
    return decode_and_augment((bytes(raw), int(label)), process_rng())


def decode_tar_sample(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return decode_and_augment((sample["jpg"], int(sample["cls"])), rng)


def decode_record(record: bytes, rng: np.random.Generator) -> dict[str, Any]:
    from aioloader.recordio import unpack

    header, raw = unpack(record)
    return decode_and_augment((raw, int(header.label)), rng)


def decode_litdata(item: dict[str, Any]) -> dict[str, Any]:
    return decode(item["image"], item["label"])


def decode_webdataset(item: tuple[bytes, bytes]) -> dict[str, Any]:
    return decode(item[0], item[1])


def label_of(key: str) -> int:
    """The label in a per-object key: `000123_4.jpg` -> 4."""
    return int(key.rsplit("_", 1)[1].split(".")[0])


# --- the loaders ---
# Each library is imported in its builder, so that a loader's process loads only its own; the
# dataset subclasses are made there too (the DataLoaders fork, so nothing has to pickle them).


@dataclass
class Built:
    """A loader ready for epochs: `loader` is iterated once per epoch, `close` ends it."""

    loader: Iterable[Any]
    close: Callable[[], None] = lambda: None


def aioloader_built(dataset: Any, decoder: Callable[..., Any], plan: Plan) -> Built:
    import aioloader

    loader = aioloader.Loader(dataset, decode=decoder, batch_size=BATCH, shuffle=True,
                              num_workers=WORKERS, concurrency=plan.concurrency,
                              persistent_workers=True)
    return Built(loader, loader.close)


def torch_built(dataset: Any, **options: Any) -> Built:
    """A torch DataLoader, 2 workers kept across epochs (forked: the datasets below keep no
    client made before the fork)."""
    import torch.utils.data

    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS,
                                         persistent_workers=True, **options)
    return Built(loader, lambda: stop_workers(loader))


def stop_workers(loader: Any) -> None:
    """End a DataLoader's persistent workers now rather than at garbage collection."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def build_aioloader_tar(plan: Plan) -> Built:
    import aioloader

    # its index cache with the other local caches, emptied before each run: the shards are
    # packed again each run, and a kept index would describe the last run's shards
    shards = aioloader.TarShards(plan.urls("tar", ".tar"),
                                 index_dir=os.path.join(plan.cache, "tar-index"))
    return aioloader_built(shards, decode_tar_sample, plan)


def build_aioloader_recordio(plan: Plan) -> Built:
    import aioloader

    dataset = aioloader.RecordIO(plan.urls("rec", ".rec"), plan.urls("rec", ".idx"))
    return aioloader_built(dataset, decode_record, plan)


def build_aioloader_files(plan: Plan) -> Built:
    import aioloader

    urls = plan.urls("files")
    dataset = aioloader.Files(urls, [label_of(u) for u in urls])
    return aioloader_built(dataset, decode_and_augment, plan)


def allow_http_in_litdata() -> None:
    """LitData downloads chunks with obstore, whose S3Store refuses an http:// endpoint unless
    told `allow_http`. LitData 0.2.76 builds that store with fixed client options (a module
    constant) and no way to add one from storage_options, and obstore ignores AWS_ALLOW_HTTP
    once client options are given; so the constant gets `allow_http` here, before any store is
    made (workers fork after this and inherit it)."""
    from litdata.streaming import downloader

    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if not isinstance(options, dict):
        raise RuntimeError("this LitData has no _OBSTORE_CLIENT_OPTIONS to add allow_http to")
    options["allow_http"] = True


def build_litdata(plan: Plan) -> Built:
    import litdata

    allow_http_in_litdata()
    dataset = litdata.StreamingDataset(
        f"s3://{plan.bucket}/litdata", cache_dir=plan.cache, shuffle=True,
        storage_options={"endpoint_url": plan.endpoint}, transform=decode_litdata)
    loader = litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=WORKERS,
                                         persistent_workers=True)
    return Built(loader, lambda: stop_workers(loader))


def build_litdata_raw(plan: Plan) -> Built:
    """StreamingRawDataset over the per-object JPEGs; its batches come through __getitems__,
    which downloads a batch's objects concurrently. The label is in each key."""
    from litdata import StreamingRawDataset

    allow_http_in_litdata()

    class Images(StreamingRawDataset):  # type: ignore[misc]
        def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
            raws = super().__getitems__(indices)
            return [decode(raw, label_of(self.items[i].path)) for i, raw in zip(indices, raws,
                                                                                  strict=True)]

        def __getitem__(self, index: int) -> dict[str, Any]:
            return self.__getitems__([index])[0]

    dataset = Images(f"s3://{plan.bucket}/files/", cache_dir=plan.cache,
                     storage_options={"endpoint_url": plan.endpoint})
    return torch_built(dataset, shuffle=True)


def build_mosaic(plan: Plan) -> Built:
    """MosaicML Streaming: the dataset downloads its index in this process with a boto3 client,
    which is dropped before the DataLoader forks so that each worker makes its own."""
    base = import_streaming_base()

    class Images(base.StreamingDataset):  # type: ignore[misc,name-defined]
        def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
            sample = super().get_item(sample_id, retry)
            return decode(sample["image"], sample["label"])

    dataset = Images(remote=f"s3://{plan.bucket}/mds", local=plan.cache, shuffle=True,
                     batch_size=BATCH)
    for stream in dataset.streams:
        stream._downloader.clean_up()
    return torch_built(dataset)


def build_webdataset(plan: Plan) -> Built:
    """WebDataset over plain http:// URLs of the shards (read with curl, as webdataset does);
    the proxy answers them without checking signatures, as a public bucket or presigned URLs
    would be answered."""
    import webdataset

    urls = [f"{plan.endpoint}/{plan.bucket}/{key}" for key in plan.keys["wds"]]
    dataset = (webdataset.WebDataset(urls, shardshuffle=len(urls))
               .shuffle(1000).to_tuple("jpg", "cls").map(decode_webdataset))
    return torch_built(dataset)


class S3Objects(PerProcessS3):
    """What a PyTorch user writes for objects in S3: one get_object per item, a boto3 client
    made lazily in each worker process."""

    def __init__(self, endpoint: str, bucket: str, keys: list[str]) -> None:
        super().__init__(endpoint, bucket)
        self.keys = keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, Any]:
        key = self.keys[index]
        body = self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()
        return decode(body, label_of(key))


def build_dataloader(plan: Plan) -> Built:
    return torch_built(S3Objects(plan.endpoint, plan.bucket, plan.keys["files"]), shuffle=True)


@dataclass(frozen=True)
class Entry:
    build: Callable[[Plan], Built]
    title: str
    family: str
    """"aioloader", "peer" or "baseline"."""
    folder: str
    """The bucket folder it reads."""
    settings: str
    """What it needed in order to run here, and why."""
    imports: tuple[str, ...] = ()
    """Modules imported before the clock starts: a training script has imported them anyway."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables it needs beyond AWS_ENDPOINT_URL and the credentials; `{endpoint}`
    stands for the proxy's URL."""


AIOLOADER_SETTINGS = "AWS_ENDPOINT_URL at the proxy; nothing else"
AIOLOADER = ("aioloader", "aioloader._loader", "obstore")
"""`aioloader` imports its Loader on first use (`aioloader.Loader`): imported here like the
peers' eager imports, so that no loader's set-up includes importing its library."""
TORCH = ("torch", "torch.utils.data")
LOADERS: dict[str, Entry] = {
    "aioloader-tar": Entry(build_aioloader_tar, "aioloader TarShards", "aioloader", "tar",
                           AIOLOADER_SETTINGS, AIOLOADER),
    "aioloader-recordio": Entry(build_aioloader_recordio, "aioloader RecordIO", "aioloader",
                                "rec", AIOLOADER_SETTINGS, AIOLOADER),
    "aioloader-files": Entry(build_aioloader_files, "aioloader Files (object/sample)",
                             "aioloader", "files", AIOLOADER_SETTINGS, AIOLOADER),
    "litdata": Entry(build_litdata, "LitData StreamingDataset", "peer", "litdata",
                     "storage_options={'endpoint_url': proxy} for its boto3 client; "
                     "allow_http added to its obstore client options (a module constant: "
                     "storage_options can't reach them) for the http:// endpoint",
                     (*TORCH, "litdata")),
    "litdata-raw": Entry(build_litdata_raw, "LitData raw (object/sample)", "peer", "files",
                         "as litdata, and s3fs installed: it lists the prefix through fsspec",
                         (*TORCH, "litdata", "s3fs")),
    "mosaic": Entry(build_mosaic, "MosaicML Streaming (MDS)", "peer", "mds",
                    "S3_ENDPOINT_URL; streaming.base imported without streaming/__init__ "
                    "(which needs torchvision); the parent's boto3 client dropped before the "
                    "DataLoader forks", (*TORCH, "streaming.base"),
                    {"S3_ENDPOINT_URL": "{endpoint}"}),
    "webdataset": Entry(build_webdataset, "WebDataset (tar over http)", "peer", "wds",
                        "plain http:// URLs (read with curl), answered by the proxy unsigned, "
                        "as a public bucket or presigned URLs would be; shardshuffle given (it "
                        "warns without)",
                        (*TORCH, "webdataset")),
    "dataloader": Entry(build_dataloader, "DataLoader, boto3 GET/item", "baseline", "files",
                        "a boto3 client per worker, made lazily", (*TORCH, "boto3")),
}


# --- measuring one loader ---


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User + system seconds of `root` and every process under it, live or reaped by its
    parent (the kernel adds a reaped child's time to its parent's children_* times)."""
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def servers_cpu_seconds(pids: list[int]) -> float:
    return sum(tree_cpu_seconds(psutil.Process(pid)) for pid in pids)


@dataclass
class Phase:
    """What one phase (set-up, epoch 1, epoch 2) cost."""

    seconds: float = 0.0
    samples: int = 0
    label_sum: int = 0
    """A check that each loader hands out the samples it should."""
    first_batch: float | None = None
    cpu: float = 0.0
    server_cpu: float = 0.0
    requests: dict[str, int] = field(default_factory=dict)
    """By method."""
    forwarded: int = 0
    """Of those, how many the proxy passed to moto (the rest it answered from the files)."""
    bytes: int = 0


class Meter:
    """Wall time, the loader's process-tree CPU, the servers' CPU and the proxy's counters
    between `start` and `stop`."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.me = psutil.Process()

    def snapshot(self) -> tuple[float, float, float, Counter[str]]:
        return (time.perf_counter(), tree_cpu_seconds(self.me),
                servers_cpu_seconds(self.plan.server_pids), read_stats(self.plan.endpoint))

    def phase(self, before: tuple[float, float, float, Counter[str]]) -> Phase:
        after = self.snapshot()
        by_kind: dict[str, Counter[str]] = {}
        for name, n in (after[3] - before[3]).items():
            kind = name.split()[0]
            by_kind.setdefault("requests" if kind.isupper() else kind, Counter())[kind] += n
        return Phase(seconds=after[0] - before[0], cpu=after[1] - before[1],
                     server_cpu=after[2] - before[2],
                     requests=dict(by_kind.get("requests", {})),
                     forwarded=sum(by_kind.get("forwarded", {}).values()),
                     bytes=sum(by_kind.get("bytes", {}).values()))


def run_epoch(loader: Iterable[Any], meter: Meter) -> Phase:
    before = meter.snapshot()
    samples = label_sum = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - before[0]
        labels = np.asarray(batch["label"])
        samples, label_sum = samples + len(labels), label_sum + int(labels.sum())
    phase = meter.phase(before)
    phase.samples, phase.label_sum, phase.first_batch = samples, label_sum, first
    return phase


def import_modules(names: Iterable[str]) -> None:
    for name in names:
        if name == "streaming.base":
            import_streaming_base()
        else:
            importlib.import_module(name)


def measure(name: str, plan: Plan) -> dict[str, Any]:
    """Caches wiped, set-up (building the dataset and loader), epoch 1, epoch 2."""
    import_modules(LOADERS[name].imports)
    shutil.rmtree(plan.cache, ignore_errors=True)
    os.makedirs(plan.cache)
    meter = Meter(plan)
    before = meter.snapshot()
    built = LOADERS[name].build(plan)
    setup = meter.phase(before)
    try:
        epochs = [run_epoch(built.loader, meter) for _ in range(2)]
    finally:
        built.close()
    return {"setup": asdict(setup), "epochs": [asdict(e) for e in epochs]}


def ceiling(paths: list[str], labels: list[int], limit: int = 400) -> dict[str, float]:
    """The decode alone, in this one process, over JPEG bytes already in memory."""
    raws = [Path(p).read_bytes() for p in paths[:limit]]
    rng = np.random.default_rng(0)
    for raw, label in zip(raws[:10], labels, strict=False):  # imports, first-call costs
        decode_and_augment((raw, label), rng)
    cpu, started = time.process_time(), time.perf_counter()
    for raw, label in zip(raws, labels, strict=False):
        decode_and_augment((raw, label), rng)
    elapsed = time.perf_counter() - started
    return {"rate": len(raws) / elapsed, "cpu": (time.process_time() - cpu) / len(raws)}


def main(name: str, plan_path: str, out_path: str) -> None:
    """In the loader's own process: measure it and write the figures as JSON."""
    plan = Plan.load(plan_path)
    result = measure(name, plan)
    Path(out_path).write_text(json.dumps(result))
