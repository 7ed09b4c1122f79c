"""A decode process's life, once the zygote has forked it: take on the main process's
settings, then decode chunks until told to stop or until the main process is gone."""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import sys
import traceback

import numpy as np

from .channel import Channel, dumps_data
from .decode import DecodeSpec, WorkerInfo, one_line, respond, set_worker_info
from .messages import STOP, Done, Imported, Init, InitFailed, Ready
from .preload import installed_packages


def _start(init: Init) -> DecodeSpec:
    init.environment.take_on()
    seed = init.seed + init.worker_id
    random.seed(seed)
    np.random.seed(seed % 2**32)
    set_worker_info(WorkerInfo(init.worker_id, init.num_workers, seed))
    spec: DecodeSpec
    spec, worker_init = pickle.loads(init.code)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    init.environment.filter_warnings()  # the categories of the modules decode imported too
    if worker_init is not None:
        worker_init(init.worker_id)
    return spec


def serve(descriptor: int) -> int:
    """A decode process's life: start as told, then decode chunks until told to stop or until
    the main process is gone (end of the channel)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    channel = Channel(socket.socket(fileno=descriptor))
    preloaded = set(sys.modules)
    reported = False
    try:
        init = channel.receive()
        try:
            spec = _start(init)
        except BaseException as e:
            channel.send(InitFailed(one_line(e), traceback.format_exc()))
            return 1
        channel.send(Ready(os.getpid()))
        while (message := channel.receive()) != STOP:
            channel.send_bytes(dumps_data(Done(message.id, respond(spec, message.chunk))))
            if not reported:
                reported = True
                channel.send(Imported(installed_packages(set(sys.modules) - preloaded)))
    except (EOFError, OSError):
        pass
    finally:
        channel.close()
    return 0
