"""Large local files, and the records of local RecordIO and TFRecord files, are read in the
decode processes, where they are decoded, as DataLoader's workers read theirs: their bytes
never cross the loader's event loop nor its channel to decode. Large remote objects go from the
socket into shared memory the decode processes take them from. Measured at the process
boundary, by the kernel's own count of each process's reads and writes (/proc/PID/io), over
every process of the job, and by what the decode processes received through their channels."""

from __future__ import annotations

import contextlib
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from recordio_cases import IMAGE_HEADERS, payloads

import aioloader
from aioloader import recordio, tfrecord
from aioloader.recordio import IRHeader
from aioloader.testing import TestServer

MIB = 1 << 20
SAMPLE = 32 * MIB


def first_byte_and_pid(raw: bytes) -> np.ndarray[Any, Any]:
    """A sample's first byte and the process that decoded it: the batch's way back costs next
    to nothing."""
    return np.array([raw[0], os.getpid()])


def labelled(raw: tuple[bytes, int]) -> tuple[int, int]:
    return len(raw[0]), raw[1]


def size_label_pid(raw: tuple[bytes, int]) -> np.ndarray[Any, Any]:
    return np.array([len(raw[0]), raw[1], os.getpid()])


def large_files(folder: Path, count: int, size: int = SAMPLE) -> list[str]:
    paths = []
    for n in range(count):
        path = folder / f"{n:03d}.bin"
        path.write_bytes(bytes([n]) * size)
        paths.append(str(path))
    return paths


def job_io() -> dict[int, int]:
    """Bytes read by read(2) and its kin, files and pipes alike (a socket's recvmsg is not
    counted), by this process and each of its descendants, by pid."""
    counts = {}
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            counts[process.pid] = process.io_counters().read_chars
    return counts


@pytest.mark.parametrize("service", [None, "process"])
def test_a_large_local_file_goes_to_its_decode_process_by_name(
        tmp_path: Path, service: str | None) -> None:
    paths = large_files(tmp_path, 4)
    loader = aioloader.Loader(aioloader.Files(paths), decode=first_byte_and_pid, batch_size=1,
                              num_workers=2, persistent_workers=True, service=service)
    with loader:
        first = [int(batch[0, 0]) for batch in loader]  # every process started
        before = job_io()
        batches = list(loader)
        after = job_io()
        stats = loader.stats
    assert sorted(first) == sorted(int(batch[0, 0]) for batch in batches) == [0, 1, 2, 3]
    decoders = {int(batch[0, 1]) for batch in batches}
    read = {True: 0, False: 0}
    for pid in before.keys() & after.keys():
        read[pid in decoders] += after[pid] - before[pid]
    # each file read by the process that decodes it, and by no other (through the event loop it
    # was read by the main process or the service, and sent on)
    assert 4 * SAMPLE <= read[True] < 5 * SAMPLE, read[True] / MIB
    assert read[False] < SAMPLE // 4, read[False] / MIB
    assert stats.read_in_decode
    assert "local files are read in the decode processes" in stats.report()


@pytest.mark.parametrize("service", [None, "process"])
def test_a_large_remote_object_goes_to_its_decode_process_in_shared_memory(
        tmp_path: Path, service: str | None) -> None:
    large_files(tmp_path, 4)
    with TestServer(tmp_path) as server:
        urls = [f"{server.url}{n:03d}.bin" for n in range(4)]
        loader = aioloader.Loader(aioloader.Files(urls, labels=range(4)),
                                  decode=size_label_pid, batch_size=1, num_workers=2,
                                  persistent_workers=True, service=service)
        with loader:
            assert sorted(int(batch[0, 1]) for batch in loader) == [0, 1, 2, 3]  # sizes learnt
            sent_before, before = loader.stats.bytes_to_decode, job_io()
            batches = list(loader)
            after, stats = job_io(), loader.stats
    assert sorted((int(b[0, 0]), int(b[0, 1])) for b in batches) == [(SAMPLE, n) for n in range(4)]
    decoders = {int(batch[0, 2]) for batch in batches}
    read = {True: 0, False: 0}
    for pid in (before.keys() & after.keys()) - {server.pid}:
        read[pid in decoders] += after[pid] - before[pid]
    # read from the socket once (uvloop's reads are read(2)), by the main process or the
    # service; taken from shared memory by the decode processes (by pread; their channel's
    # recv is not counted), which received a few hundred bytes per chunk through it
    assert 4 * SAMPLE <= read[True] < 5 * SAMPLE, read[True] / MIB
    assert read[False] < 5 * SAMPLE, read[False] / MIB
    assert stats.bytes_to_decode - sent_before < 4 * 4096
    assert stats.shared_bytes == 4 * SAMPLE
    assert "134.2 MB read into shared memory for decode" in stats.report()
    assert not stats.read_in_decode


def test_small_local_files_are_read_in_the_event_loop(tmp_path: Path) -> None:
    paths = large_files(tmp_path, 20, size=4096)
    loader = aioloader.Loader(aioloader.Files(paths), decode=first_byte_and_pid, batch_size=4,
                              num_workers=2, service=None)
    assert sorted(int(b[0]) for batch in loader for b in batch) == list(range(20))
    assert not loader.stats.read_in_decode
    assert loader.stats.bytes_read == 20 * 4096


@pytest.mark.parametrize("service", [None, "process"])
def test_a_large_file_that_cannot_be_read_fails_as_a_read_naming_it(
        tmp_path: Path, service: str | None) -> None:
    paths = large_files(tmp_path, 3, size=2 * MIB)
    missing = str(tmp_path / "gone.bin")
    paths.insert(1, missing)
    loader = aioloader.Loader(aioloader.Files(paths, labels=[0, 1, 2, 3]), decode=labelled,
                              batch_size=1, num_workers=2, service=service)
    with pytest.raises(aioloader.FetchError) as caught:
        list(loader)
    error = caught.value
    assert isinstance(error, aioloader.SampleError)
    assert (error.index, error.key, error.stage, error.url) == (1, missing, "fetch", missing)
    assert f"fetch failed for sample 1 (key {missing!r}): reading {missing} failed: " \
           "FileNotFoundError" in str(error)

    skipping = aioloader.Loader(aioloader.Files(paths, labels=[0, 1, 2, 3]), decode=labelled,
                                batch_size=1, num_workers=2, service=service, on_error="skip")
    labels = [int(batch[1][0]) for batch in skipping]
    assert labels == [0, 2, 3]
    assert skipping.stats.skipped == 1
    assert list(skipping.stats.skip_reasons) == [str(error)]
    assert os.path.getsize(paths[0]) == 2 * MIB


def digest_and_pid(raw: bytes) -> np.ndarray[Any, Any]:
    return np.array([zlib.crc32(raw), os.getpid()])


def record_files(folder: Path, fmt: str, records: list[bytes]) -> aioloader.Dataset:
    """`records` in two files of `fmt`, with their indexes, as a dataset of them."""
    halves = [records[:len(records) // 2], records[len(records) // 2:]]
    if fmt == "rec":
        for n, half in enumerate(halves):
            with recordio.Writer(folder / f"{n}.rec", folder / f"{n}.idx") as writer:
                for record in half:
                    writer.write(record)
        return aioloader.RecordIO([str(folder / f"{n}.rec") for n in range(2)],
                                  [str(folder / f"{n}.idx") for n in range(2)])
    for n, half in enumerate(halves):
        with tfrecord.Writer(folder / f"{n}.tfrecord") as writer:
            for record in half:
                writer.write(record)
    return aioloader.TFRecord([str(folder / f"{n}.tfrecord") for n in range(2)])


@pytest.mark.parametrize("fmt", ["rec", "tfrecord"])
@pytest.mark.parametrize("service", [None, "process"])
def test_local_records_are_read_and_unframed_in_their_decode_process(
        tmp_path: Path, fmt: str, service: str | None) -> None:
    records = [bytes([n]) * (256 << 10) for n in range(64)]
    dataset = record_files(tmp_path, fmt, records)
    loader = aioloader.Loader(dataset, decode=digest_and_pid, batch_size=8, shuffle=True,
                              num_workers=2, persistent_workers=True, service=service)
    with loader:
        list(loader)  # every process started
        before = job_io()
        batches = list(loader)
        after = job_io()
        stats = loader.stats
    assert sorted(int(d) for batch in batches for d in batch[:, 0]) == sorted(
        zlib.crc32(record) for record in records)
    decoders = {int(p) for batch in batches for p in batch[:, 1]}
    read = {True: 0, False: 0}
    for pid in before.keys() & after.keys():
        read[pid in decoders] += after[pid] - before[pid]
    data = sum(map(len, records))
    # each record read (framing included) by the process that decodes it, and by no other
    assert data <= read[True] < data * 1.1, read[True] / MIB
    assert read[False] < data // 16, read[False] / MIB
    assert stats.read_in_decode
    assert stats.bytes_to_decode < 64 * 1024  # where each record lies, not its bytes


def test_mxnet_records_split_at_an_embedded_magic_are_whole_when_read_in_decode() -> None:
    data = Path(__file__).parent / "data"
    golden = [*payloads(), *(recordio.pack(IRHeader(*h), p) for h, p in IMAGE_HEADERS)]
    loader = aioloader.Loader(aioloader.RecordIO(str(data / "golden.rec")), batch_size=None,
                              num_workers=2, service=None)
    assert list(loader) == golden
    assert loader.stats.read_in_decode


def test_remote_records_are_read_in_the_event_loop(tmp_path: Path) -> None:
    records = [bytes([n]) * 4096 for n in range(16)]
    record_files(tmp_path, "tfrecord", records)
    with TestServer(tmp_path) as server:
        dataset = aioloader.TFRecord([f"{server.url}{n}.tfrecord" for n in range(2)])
        loader = aioloader.Loader(dataset, decode=digest_and_pid, batch_size=4, num_workers=2,
                                  service=None)
        assert sorted(int(d) for batch in loader for d in batch[:, 0]) == sorted(
            zlib.crc32(record) for record in records)
    assert not loader.stats.read_in_decode


@pytest.mark.parametrize("service", [None, "process"])
def test_a_damaged_record_read_in_decode_names_its_sample_and_the_cause(
        tmp_path: Path, service: str | None) -> None:
    records = [bytes([n]) * 1000 for n in range(8)]
    record_files(tmp_path, "tfrecord", records)
    path = tmp_path / "0.tfrecord"
    damaged = bytearray(path.read_bytes())
    damaged[2 * (1000 + tfrecord.FRAMING) + 100] ^= 0xFF  # inside record 2's data
    path.write_bytes(damaged)
    files = [str(tmp_path / f"{n}.tfrecord") for n in range(2)]
    loader = aioloader.Loader(aioloader.TFRecord(files), decode=digest_and_pid, batch_size=1,
                              num_workers=2, service=service)
    with pytest.raises(aioloader.SampleError) as caught:
        list(loader)
    # a failed read, as it is when the event loop reads the record (num_workers=0)
    assert (caught.value.index, caught.value.stage) == (2, "fetch")
    assert f"{path}: bad record at offset {2 * (1000 + tfrecord.FRAMING)}: the CRC of its " \
           "1000 bytes of data does not match" in str(caught.value)
    skipping = aioloader.Loader(aioloader.TFRecord(files), decode=digest_and_pid, batch_size=1,
                                num_workers=2, service=service, on_error="skip")
    assert sorted(int(batch[0, 0]) for batch in skipping) == sorted(
        zlib.crc32(record) for n, record in enumerate(records) if n != 2)
    assert skipping.stats.skipped == 1
