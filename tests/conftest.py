"""Fixtures: sample files on disk, the project's HTTP test server on loopback, leak checks."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from aioloader._processes.zygote import Zygote
from aioloader.testing import Nginx, TestServer

from decoders import SAMPLE_COUNT, write_samples


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("samples")
    write_samples(folder, SAMPLE_COUNT)
    return folder


@pytest.fixture(scope="session")
def server(sample_dir: Path) -> Iterator[TestServer]:
    with TestServer(sample_dir) as running:
        yield running


@pytest.fixture
def faulty_server(sample_dir: Path) -> Iterator[TestServer]:
    """A server of this test's own, whose faults the test sets with set_faults()."""
    with TestServer(sample_dir) as running:
        yield running


@pytest.fixture(scope="session")
def web_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files put here are served by the session's nginx; use names unique to the test."""
    return tmp_path_factory.mktemp("web")


@pytest.fixture(scope="session")
def nginx(web_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    if shutil.which("nginx") is None and not os.path.exists("/usr/sbin/nginx"):
        if os.environ.get("CI"):
            pytest.fail("nginx must be installed in CI (apt-get install nginx-light)")
        pytest.skip("nginx is not installed (apt-get install nginx-light)")
    with Nginx(web_root, tmp_path_factory.mktemp("nginx-state")) as running:
        yield running


S3_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_server(environment: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3 server in its own process on 127.0.0.1 (a free port); its endpoint URL."""
    pytest.importorskip("moto")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **(environment or {})},
    )
    try:
        deadline = time.monotonic() + 30
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail("moto's S3 server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server; AWS_* variables point at it."""
    pytest.importorskip("obstore")
    saved = {k: os.environ.get(k) for k in [*S3_ENVIRONMENT, "AWS_ENDPOINT_URL"]}
    try:
        with moto_server() as endpoint:
            os.environ.update(S3_ENVIRONMENT, AWS_ENDPOINT_URL=endpoint)
            yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def local_paths(sample_dir: Path) -> list[str]:
    return [str(sample_dir / f"{i:04d}.bin") for i in range(SAMPLE_COUNT)]


@pytest.fixture
def urls(server: TestServer) -> list[str]:
    return [f"{server.url}{i:04d}.bin" for i in range(SAMPLE_COUNT)]


@dataclass(frozen=True)
class Snapshot:
    processes: frozenset[int]
    threads: frozenset[int]
    sockets: int
    unix_sockets: int


HELPERS = ("forkserver", "resource_tracker", "aioloader._processes.zygote_main")
LASTING_THREADS = ("aioloader-reaper", "aioloader-zygote-reap")
"""Threads that live as long as the interpreter, as the zygote: the one finalizers hand their
work to, and the one that reaps the zygote when it ends."""


def ended(process: psutil.Process | int) -> bool:
    """Whether the process exited (a zombie counts: its parent reaps it later), asked in one
    step: one that ends between two questions is not an error."""
    try:
        process = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ours(process: psutil.Process) -> bool:
    """Helpers that live as long as the interpreter (Python's forkserver and resource tracker,
    aioloader's zygote: our direct children) are not a test's; the decode processes the zygote
    forks are."""
    try:
        command = " ".join(process.cmdline())
        helper = process.ppid() == os.getpid()
    except psutil.Error:
        return False
    return not (helper and any(name in command for name in HELPERS))


def _lasting_unix_sockets() -> set[int]:
    """Unix sockets whose owners outlive a test: the zygote's control socket (it lives as
    long as the interpreter) and the wake-up pairs of event loops still open (nbclient keeps
    one per thread; a loop the loader runs has a thread, which the check counts)."""
    zygote = Zygote._instance
    lasting = {zygote._channel.socket.fileno()} if zygote is not None else set()
    for loop in gc.get_objects():
        if issubclass(type(loop), asyncio.BaseEventLoop) and not loop.is_closed():
            pair = (getattr(loop, "_ssock", None), getattr(loop, "_csock", None))
            lasting.update(end.fileno() for end in pair if end is not None)
    return lasting


def _unix_sockets(me: psutil.Process) -> int:
    """This process's Unix sockets (decode channels, socket pairs) but the lasting ones."""
    lasting = _lasting_unix_sockets()
    return sum(1 for c in me.net_connections(kind="unix") if c.fd not in lasting)


def snapshot() -> Snapshot:
    me = psutil.Process()
    children = frozenset(p.pid for p in me.children(recursive=True) if _ours(p))
    threads = frozenset(t.ident for t in threading.enumerate()
                        if t.ident is not None and t.name not in LASTING_THREADS)
    return Snapshot(children, threads, len(me.net_connections(kind="inet")), _unix_sockets(me))


@pytest.fixture
def leak_check() -> Iterator[None]:
    """Fails the test if it leaves processes, threads or sockets (inet or Unix) behind 5 s
    after it ends."""
    before = snapshot()
    yield
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        now = snapshot()
        extra_processes = now.processes - before.processes
        extra_threads = now.threads - before.threads
        extra_sockets = now.sockets - before.sockets
        extra_unix = now.unix_sockets - before.unix_sockets
        if not (extra_processes or extra_threads or extra_sockets > 0 or extra_unix > 0):
            return
        if time.monotonic() > deadline:
            names = [t.name for t in threading.enumerate() if t.ident in extra_threads]
            pytest.fail(
                f"left behind: processes {sorted(extra_processes)}, threads {names}, "
                f"{extra_sockets} sockets, {extra_unix} Unix sockets"
            )
        time.sleep(0.05)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Indexes of tar shards and other cached files go to a folder of the test session's."""
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = saved
