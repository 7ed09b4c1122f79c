"""A decode process's life, once the zygote has forked it: take on the main process's
settings, then decode chunks until told to stop or until the main process is gone."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import random
import signal
import socket
import sys
import traceback

import numpy as np

from .._errors import type_name
from .._ipc.channel import Channel, dumps_data
from .._ipc.messages import STOP, Done, Imported, Init, InitFailed, Ready
from .decode import DecodeSpec, WorkerInfo, one_line, respond, set_worker_info
from .preload import installed_packages

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
"""glibc malloc's thresholds in a decode process: where its own dynamic rule ends up in a long
run (the largest mmap threshold it moves to, and twice that for trimming)."""
_USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def steady_allocator() -> None:
    """Start a decode process with glibc's malloc thresholds where a long run leaves them. A
    fresh process starts at 128 KiB: each decoded image's buffers are mapped and unmapped, and
    the heap is trimmed after every batch, about 330 page faults per 500x375 JPEG for the first
    few hundred images (1.3-2 ms of CPU each on 2 cores here). Left alone where the user set
    MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or any GLIBC_TUNABLES, and under other C
    libraries. The environment read is the zygote's, which glibc read when it started (the
    trainer's, as it was then), not the one a pass's Init brings."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _USER_SETTINGS):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    mallopt(-1, TRIM_THRESHOLD)  # M_TRIM_THRESHOLD


def _start(init: Init) -> DecodeSpec:
    init.environment.take_on()
    seed = init.seed + init.worker_id
    random.seed(seed)
    np.random.seed(seed % 2**32)
    set_worker_info(WorkerInfo(init.worker_id, init.num_workers, seed))
    spec: DecodeSpec
    spec, worker_init = pickle.loads(init.code)
    reader = getattr(spec.load, "__self__", None)  # from_torch's wrapper: `.dataset` is the copy
    info = WorkerInfo(init.worker_id, init.num_workers, seed, getattr(reader, "dataset", None))
    set_worker_info(info)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
        _tell_torch(info)
    init.environment.filter_warnings()  # the categories of the modules decode imported too
    if worker_init is not None:
        worker_init(init.worker_id)
    return spec


def _tell_torch(info: WorkerInfo) -> None:
    """`torch.utils.data.get_worker_info()` answers in a decode process as in a DataLoader
    worker (a dataset written for DataLoader shards by it)."""
    with contextlib.suppress(ImportError, AttributeError, TypeError):
        worker = importlib.import_module("torch.utils.data._utils.worker")
        worker.__dict__["_worker_info"] = worker.WorkerInfo(  # where DataLoader's worker sets it
            id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset)


def serve(descriptor: int) -> int:
    """A decode process's life: start as told, then decode chunks until told to stop or until
    the main process is gone (end of the channel)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    steady_allocator()
    channel = Channel(socket.socket(fileno=descriptor))
    preloaded = set(sys.modules)
    reported = False
    try:
        init = channel.receive()
        try:
            spec = _start(init)
        except BaseException as e:
            channel.send(InitFailed(one_line(e), traceback.format_exc(), type_name(e)))
            return 1
        channel.send(Ready(os.getpid()))
        while (message := channel.receive()) != STOP:
            result = respond(spec, message.chunk)
            result.received = channel.received
            channel.send_bytes(dumps_data(Done(message.id, result)))
            del result
            if not reported:
                reported = True
                channel.send(Imported(installed_packages(set(sys.modules) - preloaded)))
    except (EOFError, OSError):
        pass
    finally:
        channel.close()
    return 0
