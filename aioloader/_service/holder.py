"""A Loader's loader service, from this side: what travels to it (the configuration, pickled
when the Loader is built and again as each pass starts), the client, started on first use and
kept until close, and the warm-up that starts what the first pass needs while the caller
builds the rest of the job."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import deque

from .._closing import ProcessBound
from .._config import LoaderConfig
from .._errors import LoaderError
from .._ipc.channel import dumps
from .._processes.zygote import Zygote
from .._stats import LoaderStats
from .._worker.decode import DecodeSpec
from .._worker.preload import packages_behind
from . import rendezvous
from .client import ServiceClient, load_stats
from .fingerprint import fingerprint


class ServiceHolder(ProcessBound):
    """Kept apart from the Loader so a finalizer can close it. A service found lost or cut off
    is replaced at the next pass."""

    def __init__(self) -> None:
        super().__init__()
        self.code = b""
        """The configuration, pickled when the Loader was built, then as the last pass began."""
        self._passes = 0
        self.fingerprint = ""
        """For a node's service: what every rank with the same Loader computes alike."""
        self.packages: list[str] = []
        """What decode imports, imported in the zygote before it forks decode processes."""
        self._client: ServiceClient | None = None
        self._last: bytes | None = None
        self._lock = threading.Lock()
        self._closed = False

    def prepare(self, config: LoaderConfig, spec: DecodeSpec) -> None:
        """Fail here, not in a decode process or the service, when something cannot travel;
        then warm up on a thread of its own. With a service, the configuration is all that
        travels (decode and worker_init inside it): it is pickled once, and the parts only to
        name the one that cannot."""
        if config.service is None:
            pickled = _pickled_for_decode(config, spec)
        else:
            try:
                self.code = dumps(config)
                if config.service == "node":  # what every rank of the node computes alike
                    self.fingerprint = fingerprint(
                        dataclasses.replace(config, rank=0, world_size=1))
            except Exception as e:
                _pickled_for_decode(config, spec)  # raises naming decode or worker_init
                raise ValueError(
                    f"the dataset cannot be sent to the loader service: {type(e).__name__}: "
                    f"{e}. It holds something that cannot be pickled (an open file, a "
                    f"client); make it picklable, or keep the loader in this process with "
                    f"service=None. {_SHARED_OBJECTS}"
                ) from e
            pickled = [self.code]
        self.packages = packages_behind(pickled)
        # start the helper that forks decode processes now, with what decode imports, and the
        # loader service, while the caller builds the rest of the job: the first batch need
        # not wait for them (a node's service has its own helper)
        threading.Thread(target=_warm_up, args=(self, config), name="aioloader-warm-up",
                         daemon=True).start()

    def start(self, config: LoaderConfig, for_a_pass: bool = False) -> ServiceClient:
        """The service's client, the service started (again, if it was lost) if need be.
        `for_a_pass`: a pass is about to begin, and takes the dataset as it is now, as each
        pass of a DataLoader's workers does: a process service whose configuration pickles
        otherwise now (an attribute set, items appended) is replaced. With
        `persistent_workers`, as DataLoader's persistent workers keep theirs, only the first
        pass looks (the warm-up's start is none)."""
        with self._lock:
            if self._closed:
                raise LoaderError("this Loader is closed; build a new one")
            if for_a_pass:
                self._passes += 1
            if for_a_pass and config.service == "process" and (
                    self._passes == 1 or not config.persistent_workers):
                self._take_dataset_as_now(config)
            if self._client is not None and self._client.broken is not None:
                self._client.close()
                self._client = None
            if self._client is None:
                self._client = rendezvous.connect(
                    self.code, self.fingerprint, self.packages, config.stall_timeout
                ) if config.service == "node" else ServiceClient.spawn(
                    self.code, self.packages, config.stall_timeout)
            return self._client

    def _take_dataset_as_now(self, config: LoaderConfig) -> None:
        code = dumps(config)
        if code != self.code:
            self.code = code
            if self._client is not None:  # its last stats stay, as when it closes
                self._last = self._client.last_stats or self._last
                self._client.close()
                self._client = None

    def stats(self, here: LoaderStats) -> LoaderStats:
        """The service's stats (asked for while a pass runs, else as the last pass left them),
        with the batches handed over and the waits measured here; `here` alone without a
        service."""
        client = self._client
        if client is not None:
            now = None
            if client.pass_open and not client.closed:
                with contextlib.suppress(LoaderError):
                    now = client.stats()
            self._last = now or client.last_stats or self._last  # not the last pass's end
        if self._last is None:
            return here
        merged = load_stats(self._last)
        merged.batches, merged.consumer_wait = here.batches, here.consumer_wait
        merged.consumer_work = here.consumer_work
        merged.raw_events = deque(
            sorted([e for e in merged.raw_events if e[0] != "consumer"] + list(here.raw_events),
                   key=lambda event: event[1]),
            maxlen=merged.raw_events.maxlen)
        return merged

    def close(self) -> None:
        """In a forked child, only its copy of the socket is let go of, without the lock (a
        thread of the parent may have held it at the fork)."""
        if self.foreign:
            client, self._client = self._client, None
        else:
            with self._lock:
                client, self._client, self._closed = self._client, None, True
        if client is not None:
            self._last = client.last_stats or self._last
            client.close()


_SHARED_OBJECTS = (
    "multiprocessing's Value, Array, Lock, Semaphore and Queue are shared when made from a "
    "spawn or forkserver context (multiprocessing.get_context('spawn').Value(...)); those "
    "of a fork context cannot leave their process.")


def _pickled_for_decode(config: LoaderConfig, spec: DecodeSpec) -> list[bytes]:
    pickled = []
    for name, value in (("decode", spec), ("worker_init", config.worker_init)):
        try:
            pickled.append(dumps(value))
        except Exception as e:
            raise ValueError(
                f"{name} cannot be sent to the decode processes: {type(e).__name__}: {e}. "
                "It (or what it refers to) holds something that cannot be pickled, such "
                f"as an open file or a socket; or use num_workers=0. {_SHARED_OBJECTS}"
            ) from e
    return pickled


def _warm_up(service: ServiceHolder, config: LoaderConfig) -> None:
    """Start the zygote with the packages imported (a node's service has its own), then the
    loader service if there is one. Given the holder and the configuration, not the Loader: a
    Loader dropped meanwhile is finalized (closing what was started) rather than kept alive by
    this thread."""
    with contextlib.suppress(Exception):  # a failure shows, with its cause, at the first pass
        if config.service == "node":
            return
        Zygote.get().preload(service.packages)
        if config.service == "process":
            service.start(config)
