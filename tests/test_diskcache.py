"""The disk cache of remote bytes (`cache_dir=`), shared by processes and threads: right bytes,
no error, the size within the limit, and nothing left behind by a crash or a full disk.

The processes are real: this file is also the script they run (`python test_diskcache.py KIND
JSON`), so each test starts them with `child` and reads the JSON line they print.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader.storage._diskcache import DEBRIS_AGE, DiskCache, _key
from aioloader.storage._version import Version
from aioloader.testing import Nginx, TestServer

from decoders import index_of

OBJECTS = 150
LARGEST = 62 << 10
BIG = 16 << 20
BIG_FIRST = 1000
BIG_COUNT = 4
LIMIT = 1 << 20
"""Well below the ~4.6 MiB of the small objects, so eviction runs all the time."""
ROUND_SECONDS = 60.0


def object_bytes(index: int) -> bytes:
    """Object i: its index, then bytes drawn from it; small ones are 2 to 62 KiB (some kept
    in the index, some as files), the big ones 16 MiB."""
    size = BIG if index >= BIG_FIRST else 2048 + index * 7919 % (LARGEST - 2048)
    return struct.pack("<I", index) + np.random.default_rng(index).bytes(size - 4)


def checked(raw: bytes) -> int:
    """The object's index if its bytes are right, else -1."""
    index = int(struct.unpack_from("<I", raw)[0])
    return index if raw == object_bytes(index) else -1


def sizes(folder: Path) -> dict[Path, int]:
    """Every file under `folder` and its size, however the cache lays them out."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile
                found[Path(root, name)] = os.stat(os.path.join(root, name)).st_size
    return found


def folder_bytes(folder: Path, skip: tuple[str, ...] = ()) -> int:
    return sum(size for path, size in sizes(folder).items() if not path.name.endswith(skip))


# -- what the processes run --------------------------------------------------------------------


def read_epochs(base: str, folder: str, limit: int, epochs: int, seed: int,
                indices: list[int] | None = None) -> dict[str, Any]:
    """Epochs of the objects through a loader with 32 reads in flight; which came back
    wrong or missing, and the cache's report."""
    wanted = list(range(OBJECTS)) if indices is None else indices
    wrong = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with aioloader.Loader(
            aioloader.Files([f"{base}{i:04d}.obj" for i in wanted]), decode=checked,
            batch_size=None, shuffle=True, seed=seed, concurrency=32, num_workers=0,
            cache_dir=folder, cache_limit=limit,
        ) as loader:
            for _ in range(epochs):
                wrong += sorted(loader) != sorted(wanted)
            report = dict(loader.stats.cache)
    cache_warnings = [str(w.message) for w in caught if "disk cache" in str(w.message)]
    return {"wrong_epochs": wrong, "report": report, "warnings": cache_warnings}


def main() -> None:
    kind, arguments = sys.argv[1], json.loads(sys.argv[2])
    if kind == "epochs":
        print(json.dumps(read_epochs(**arguments)), flush=True)
    elif kind == "churn":  # epochs until told how long
        deadline = time.monotonic() + arguments.pop("seconds")
        while time.monotonic() < deadline:
            read_epochs(**arguments)
        print(json.dumps({"done": True}), flush=True)
    else:
        raise SystemExit(f"unknown kind {kind}")


# -- how the tests start them ------------------------------------------------------------------


def environment() -> dict[str, str]:
    """The children import this tree's aioloader and this folder's modules."""
    package_root = str(Path(aioloader.__file__).resolve().parents[1])
    paths = [package_root, str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def no_child_left() -> Iterator[None]:
    """A test that fails half-way kills the processes it started."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=ROUND_SECONDS)


def child(kind: str, prefix: tuple[str, ...] = (), file_size: int | None = None,
          **arguments: Any) -> subprocess.Popen[str]:
    """`python this-file KIND JSON`, after `prefix`; `file_size` bounds the files it writes."""

    def limit_file_size() -> None:
        if file_size is not None:  # Python ignores SIGXFSZ: a longer write fails with EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    command = [*prefix, sys.executable, __file__, kind, json.dumps(arguments)]
    process = subprocess.Popen(command, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=limit_file_size)
    STARTED.append(process)
    return process


def result(process: subprocess.Popen[str], timeout: float = ROUND_SECONDS) -> dict[str, Any]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    assert process.returncode == 0, f"child failed ({process.returncode}):\n{err[-3000:]}"
    answer: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return answer


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestServer]:
    folder = tmp_path_factory.mktemp("objects")
    for index in [*range(OBJECTS), *range(BIG_FIRST, BIG_FIRST + BIG_COUNT)]:
        (folder / f"{index:04d}.obj").write_bytes(object_bytes(index))
    with TestServer(folder) as running:
        yield running


# -- the tests ---------------------------------------------------------------------------------


def test_two_processes_share_a_folder_under_eviction_without_error(
    objects: TestServer, tmp_path: Path
) -> None:
    """Each process once kept its own idea of the folder and crashed (KeyError) on files the
    other evicted. While both run, the folder may pass the limit by what is being written
    (one object per read in flight: 2 x 32 x 62 KiB) and SQLite's write-ahead log; at rest,
    not at all."""
    folder = tmp_path / "shared"
    readers = [child("epochs", base=objects.url, folder=str(folder), limit=LIMIT, epochs=3,
                     seed=seed) for seed in (1, 2)]
    largest = 0
    deadline = time.monotonic() + ROUND_SECONDS
    while any(r.poll() is None for r in readers) and time.monotonic() < deadline:
        largest = max(largest, folder_bytes(folder, skip=("-wal", "-shm")))
        time.sleep(0.01)
    answers = [result(r) for r in readers]
    assert [(a["wrong_epochs"], a["warnings"]) for a in answers] == [(0, []), (0, [])]
    assert all(a["report"]["disk_hits"] > 0 and a["report"]["disk_misses"] > 0 for a in answers)
    assert largest <= LIMIT + 2 * 32 * LARGEST
    assert folder_bytes(folder) <= LIMIT


def test_32_reads_in_flight_share_the_cache_under_eviction_without_error(
    objects: TestServer, tmp_path: Path
) -> None:
    """32 threads of one process once raced on the cache's bookkeeping (KeyError) and let the
    folder grow past the limit."""
    limit = 3 << 20  # most objects fit: many hits, each racing with evictions
    answer = read_epochs(objects.url, str(tmp_path / "one"), limit, epochs=5, seed=3)
    assert answer["wrong_epochs"] == 0 and answer["warnings"] == []
    assert answer["report"]["disk_hits"] > 0
    gc.collect()  # the cache's SQLite connections close: the write-ahead log goes
    assert folder_bytes(tmp_path / "one") <= limit


def test_opening_a_folder_while_another_process_evicts_from_it(
    objects: TestServer, tmp_path: Path
) -> None:
    """Opening once listed the folder and then failed (FileNotFoundError) on a file another
    process evicted in between."""
    folder = tmp_path / "busy"
    churn = child("churn", base=objects.url, folder=str(folder), limit=LIMIT, epochs=2,
                  seed=4, seconds=4.0)
    opened = 0
    deadline = time.monotonic() + ROUND_SECONDS
    while churn.poll() is None and time.monotonic() < deadline:
        if folder.exists():
            report = DiskCache(folder, LIMIT).report()
            assert report.get("disk_write_errors", 0) == 0, "opening failed (and was warned)"
            opened += 1
    assert result(churn) == {"done": True}
    assert opened > 10


def test_a_writer_killed_mid_write_leaves_nothing_to_break_readers_or_grow(
    objects: TestServer, tmp_path: Path
) -> None:
    """kill -9 of a process while it writes a 16 MiB object once left a half-written file that
    no one counted or removed. Now a fresh process reads and writes as usual, and removes such
    a file once it is older than a live writer's can be."""
    folder = tmp_path / "crash"
    limit = 40 << 20  # room for two big objects
    caught: list[Path] = []
    for index in range(BIG_FIRST, BIG_FIRST + BIG_COUNT):
        before = sizes(folder)
        writer = child("epochs", base=objects.url, folder=str(folder), limit=limit, epochs=1,
                       seed=0, indices=[index])
        deadline = time.monotonic() + ROUND_SECONDS
        new: list[Path] = []
        while not new and writer.poll() is None and time.monotonic() < deadline:
            new = [path for path, size in sizes(folder).items() if path not in before
                   and size > 0 and not path.name.startswith("cache.db")]
        writer.send_signal(signal.SIGKILL)  # the moment its object's file appears
        writer.communicate(timeout=ROUND_SECONDS)
        caught += [path for path, size in sizes(folder).items() if path in new and size < BIG]
    assert caught, "no kill landed mid-write"
    an_hour_ago = time.time() - max(3600.0, 2 * DEBRIS_AGE)
    for path in sizes(folder):  # as if the crash were an hour ago
        os.utime(path, (an_hour_ago, an_hour_ago))
    everything = [*range(OBJECTS), *range(BIG_FIRST, BIG_FIRST + BIG_COUNT)]
    answer = result(child("epochs", base=objects.url, folder=str(folder), limit=limit,
                          epochs=2, seed=5, indices=everything))
    assert answer["wrong_epochs"] == 0 and answer["warnings"] == []
    assert answer["report"]["disk_hits"] > 0
    assert [p for p in caught if p.exists()] == []
    assert folder_bytes(folder) <= limit


def test_a_fresh_unnamed_value_file_is_kept_and_an_old_one_removed(tmp_path: Path) -> None:
    """A value file no row names yet may be a live writer's, about to name it: only one older
    than that could take is a crashed writer's, and goes."""
    DiskCache(tmp_path, LIMIT)
    (tmp_path / "ab" / "cd").mkdir(parents=True)
    fresh = tmp_path / "ab" / "cd" / f"{'1' * 28}.val"
    old = tmp_path / "ab" / "cd" / f"{'2' * 28}.val"
    fresh.write_bytes(b"live")
    old.write_bytes(b"dead")
    long_ago = time.time() - 2 * DEBRIS_AGE
    os.utime(old, (long_ago, long_ago))
    DiskCache(tmp_path, LIMIT)
    assert fresh.exists() and not old.exists()


def test_files_of_the_cache_before_its_index_are_removed(tmp_path: Path) -> None:
    """The cache once named files by a hash of (URL, range) and wrote them as .incoming-*
    first: nothing reads such files now, and left alone they would fill the disk uncounted."""
    hashed, incoming = tmp_path / ("a" * 64), tmp_path / ".incoming-x1y2"
    hashed.write_bytes(b"old entry")
    incoming.write_bytes(b"half an old entry")
    (tmp_path / "notes.txt").write_text("not the cache's")
    DiskCache(tmp_path, LIMIT)
    assert not hashed.exists() and not incoming.exists() and (tmp_path / "notes.txt").exists()


def can_mount_tmpfs(folder: Path) -> bool:
    probe = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0"',
                            str(folder)], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


@pytest.mark.parametrize("full", ["tmpfs of 1 MiB", "files of 48 KiB", "files of 256 KiB"])
def test_a_full_disk_fails_no_read(objects: TestServer, tmp_path: Path, full: str) -> None:
    """A cache write that failed (no space, or a file-size limit) once failed the sample whose
    bytes had been fetched. Now the bytes are returned and the failures counted and warned
    about once: whether the disk fills while running (tmpfs), is too full to open the index
    (48 KiB) or fills the index and refuses a 16 MiB value (256 KiB)."""
    folder = tmp_path / "full"
    folder.mkdir()
    prefix: tuple[str, ...] = ()
    file_size = None
    if full.startswith("tmpfs"):
        if not can_mount_tmpfs(folder):
            pytest.skip("cannot mount a tmpfs in a private mount namespace (needs root)")
        prefix = ("unshare", "-m", "sh", "-c",
                  'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"', str(folder))
    else:
        file_size = int(full.split()[2]) << 10  # what `ulimit -f` sets
    answer = result(child("epochs", prefix, file_size, base=objects.url, folder=str(folder),
                          limit=64 << 20, epochs=2, seed=6,
                          indices=[*range(OBJECTS), BIG_FIRST]))
    assert answer["wrong_epochs"] == 0
    assert answer["report"]["disk_write_errors"] > 0
    assert 1 <= len(answer["warnings"]) <= 2  # once for writes, once for reads at most


# -- a new job and objects that changed on the server ------------------------------------------

CHANGING = 20
NEW = 1000
"""An object's label (its first 4 bytes) is its index, then NEW + its index once rewritten."""


def labelled(label: int, index: int) -> bytes:
    """Object `index` with `label`: the same size whatever the label."""
    return struct.pack("<I", label) + bytes([index]) * (500 + index)


def write_objects(folder: Path, indices: range | list[int], new: bool = False) -> None:
    """Write the objects, dated an hour ago; or again, with new labels in as many bytes,
    dated now: seconds apart, as Last-Modified (and nginx's ETag) count them."""
    when = time.time() - (0 if new else 3600)
    for index in indices:
        path = folder / f"changing-{index:02d}.bin"
        path.write_bytes(labelled(NEW + index if new else index, index))
        os.utime(path, (when, when))


def job(urls: list[str], folder: Path) -> tuple[list[list[int]], dict[str, float]]:
    """A job: a Loader of its own, two epochs through the disk cache in `folder`; each
    epoch's labels and the cache's report."""
    with aioloader.Loader(aioloader.Files(urls), decode=index_of, batch_size=None,
                          num_workers=0, cache_dir=folder, hedge=False) as loader:
        epochs = [list(loader) for _ in range(2)]
        return epochs, dict(loader.stats.cache)


@pytest.mark.parametrize("validator", ["ETag", "Last-Modified"])
def test_a_new_job_gets_objects_changed_on_the_server_not_the_bytes_on_disk(
    tmp_path: Path, validator: str
) -> None:
    """A new job once got the old labels of all 20 objects rewritten on the server (the same
    size, a new ETag) until the folder was deleted by hand. Now it asks the server about each
    entry once (this server ignores the question and sends the object), gets the new bytes,
    and its epoch 2 asks nothing."""
    served = tmp_path / "served"
    served.mkdir()
    write_objects(served, range(CHANGING))
    with TestServer(served, no_etag=validator != "ETag") as server:
        urls = [f"{server.url}changing-{i:02d}.bin" for i in range(CHANGING)]
        old = list(range(CHANGING))
        assert job(urls, tmp_path / "cache")[0] == [old, old]
        write_objects(served, range(CHANGING), new=True)
        before = server.stats()["requests"]
        epochs, report = job(urls, tmp_path / "cache")
        asked = server.stats()["requests"] - before
    new = [NEW + i for i in range(CHANGING)]
    assert epochs == [new, new]
    assert asked == CHANGING  # epoch 1 only
    assert report["disk_replaced"] == CHANGING and report["disk_hits"] == CHANGING


def test_a_new_job_checks_unchanged_objects_with_a_304_and_rereads_changed_ones(
    nginx: Nginx, web_root: Path, tmp_path: Path
) -> None:
    """The check costs a 304 without a body for an unchanged object, and brings the new bytes
    of a changed one; epoch 2 trusts what epoch 1 checked."""
    write_objects(web_root, range(CHANGING))
    urls = [f"{nginx.url}changing-{i:02d}.bin" for i in range(CHANGING)]
    job(urls, tmp_path / "cache")
    changed = range(0, CHANGING, 2)
    write_objects(web_root, changed, new=True)
    epochs, report = job(urls, tmp_path / "cache")
    labels = [NEW + i if i in changed else i for i in range(CHANGING)]
    assert epochs == [labels, labels]
    assert report["disk_checked"] == CHANGING - len(changed)
    assert report["disk_replaced"] == len(changed)
    assert report["disk_hits"] == 2 * CHANGING - len(changed)


def test_a_new_job_gets_s3_objects_rewritten_with_the_same_size(
    s3_endpoint: str, tmp_path: Path
) -> None:
    """As over HTTP: If-None-Match the entry's ETag, a 304 for an unchanged object, the new
    bytes of a rewritten one."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="changing")

    def put(indices: range, new: bool = False) -> None:
        for i in indices:
            client.put_object(Bucket="changing", Key=f"{i:02d}.bin",
                              Body=labelled(NEW + i if new else i, i))

    put(range(CHANGING))
    urls = [f"s3://changing/{i:02d}.bin" for i in range(CHANGING)]
    job(urls, tmp_path / "cache")
    changed = range(0, CHANGING, 2)
    put(changed, new=True)
    epochs, report = job(urls, tmp_path / "cache")
    labels = [NEW + i if i in changed else i for i in range(CHANGING)]
    assert epochs == [labels, labels]
    assert report["disk_checked"] == CHANGING - len(changed)
    assert report["disk_replaced"] == len(changed)


def test_an_entry_the_server_cannot_be_asked_about_serves_only_the_job_that_read_it(
    tmp_path: Path
) -> None:
    """Without ETag or Last-Modified (the server sent neither, or an older release wrote the
    entry without its version) no conditional request can check an entry: the job that read
    the bytes trusts them, a new job reads them again."""
    url, older = "http://127.0.0.1:9/plain.bin", "http://127.0.0.1:9/older.bin"
    cache = DiskCache(tmp_path)
    cache.put(url, None, None, b"plain", Version(None, None, 5))
    first = cache.get(url, None, None)
    assert first is not None and first.trusted
    cache._cache.set(_key(older, None, None), b"older")  # as an older release wrote it
    later = DiskCache(tmp_path)
    again, old = later.get(url, None, None), later.get(older, None, None)
    assert again is not None and not again.trusted and again.version == Version(None, None, 5)
    assert old is not None and not old.trusted and old.version is None


if __name__ == "__main__":
    main()
