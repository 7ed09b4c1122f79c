"""Real HTTP servers for tests, the demo and benchmarks: the project's own, over a directory,
with injectable latency and faults; and nginx, for plain static files.

`TestServer` starts the project's server in its own process on 127.0.0.1 with a free port (also
`aioloader serve DIR --latency-ms 20` from a shell); faults can be changed while it runs
(POST /_control) and its counters read (GET /_stats). `Nginx` starts nginx the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import re
import selectors
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from ._closing import Closing

__all__ = ["Faults", "Nginx", "TestServer", "serve"]

_READY_PREFIX = "serving "
_START_TIMEOUT = 30.0
_BACKLOG = 4096
"""Room for hundreds of clients connecting at once (the default 128 drops SYNs: 1 s stalls)."""
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


@dataclass
class Faults:
    """What the server does to each request; rates are fractions of requests, drawn at random."""

    latency_ms: float = 0.0
    error_rate: float = 0.0
    """Answered 503."""
    retry_after: float | None = None
    """Seconds sent in Retry-After with those 503s; None sends none."""
    throttle_rate: float = 0.0
    """Answered 429 with Retry-After: 0."""
    drop_rate: float = 0.0
    """Connection cut after half of the body."""
    stall_rate: float = 0.0
    """Held for stall_seconds before the answer."""
    stall_seconds: float = 60.0
    seed: int = 0


class _FaultyFileServer:
    def __init__(self, root: Path, faults: Faults) -> None:
        self.root = root.resolve()
        self.faults = faults
        self.random = random.Random(faults.seed)
        self.counts: Counter[str] = Counter()
        self.in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/_control", self.control)
        app.router.add_get("/_stats", self.stats)
        app.router.add_get("/{path:.*}", self.serve_file)
        return app

    async def control(self, request: web.Request) -> web.Response:
        changes = await request.json()
        self.faults = dataclasses.replace(self.faults, **changes)
        if "seed" in changes:
            self.random = random.Random(self.faults.seed)
        return web.json_response(dataclasses.asdict(self.faults))

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.counts))

    async def serve_file(self, request: web.Request) -> web.StreamResponse:
        self.counts["requests"] += 1
        self.in_flight += 1
        self.counts["max_in_flight"] = max(self.counts["max_in_flight"], self.in_flight)
        try:
            return await self._serve_file(request)
        finally:
            self.in_flight -= 1

    async def _serve_file(self, request: web.Request) -> web.StreamResponse:
        faults = self.faults
        if faults.latency_ms:
            await asyncio.sleep(faults.latency_ms / 1000)
        roll = self.random.random()
        for name, rate in (
            ("errors", faults.error_rate),
            ("throttles", faults.throttle_rate),
            ("drops", faults.drop_rate),
            ("stalls", faults.stall_rate),
        ):
            if roll < rate:
                self.counts[name] += 1
                return await self._misbehave(name, request)
            roll -= rate
        return self._answer(request)

    async def _misbehave(self, fault: str, request: web.Request) -> web.StreamResponse:
        if fault == "errors":
            retry_after = self.faults.retry_after
            headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
            return web.Response(status=503, text="injected fault", headers=headers)
        if fault == "throttles":
            return web.Response(status=429, text="slow down", headers={"Retry-After": "0"})
        if fault == "stalls":
            await asyncio.sleep(self.faults.stall_seconds)
            return self._answer(request)
        answer = self._answer(request)
        if answer.status >= 300 or answer.body is None:
            return answer
        body = bytes(answer.body)  # type: ignore[arg-type]
        cut = web.StreamResponse(status=answer.status, headers=answer.headers)
        cut.content_length = len(body)
        await cut.prepare(request)
        await cut.write(body[: len(body) // 2])
        if request.transport is not None:
            request.transport.close()
        return cut

    def _answer(self, request: web.Request) -> web.Response:
        path = (self.root / request.match_info["path"]).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            self.counts["not_found"] += 1
            return web.Response(status=404, text=f"no such file: {request.path}")
        size = path.stat().st_size
        match = _RANGE.match(request.headers.get("Range", ""))
        if not match:
            return web.Response(body=path.read_bytes(), headers={"Accept-Ranges": "bytes"})
        first_text, last_text = match.groups()
        if first_text:
            first, last = int(first_text), min(int(last_text or size - 1), size - 1)
        else:
            first, last = max(0, size - int(last_text)), size - 1
        if first >= size or first > last:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        self.counts["ranges"] += 1
        with path.open("rb") as f:
            f.seek(first)
            body = f.read(last - first + 1)
        headers = {"Content-Range": f"bytes {first}-{last}/{size}", "Accept-Ranges": "bytes"}
        return web.Response(status=206, body=body, headers=headers)


async def serve(root: Path, host: str, port: int, faults: Faults) -> None:
    """Serve until cancelled; prints one line `serving http://HOST:PORT/` once listening."""
    runner = web.AppRunner(_FaultyFileServer(root, faults).app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=_BACKLOG, reuse_address=True)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        print(f"{_READY_PREFIX}http://{bound_host}:{bound_port}/", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class TestServer(Closing):
    """The fault-injecting server in a child process on 127.0.0.1; a context manager."""

    __test__ = False  # not a pytest test class

    def __init__(self, root: str | os.PathLike[str], port: int = 0, **faults: Any) -> None:
        """`port` 0 picks a free one; give the old port to restart a server in place."""
        options = Faults(**faults)
        command = [sys.executable, "-m", "aioloader", "serve", str(root), "--port", str(port)]
        for field in dataclasses.fields(options):
            value = getattr(options, field.name)
            if value is not None:
                command += [f"--{field.name.replace('_', '-')}", str(value)]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        self.url = self._wait_until_ready()

    def _wait_until_ready(self) -> str:
        assert self._process.stdout is not None
        line = _readline_with_timeout(self._process, _START_TIMEOUT)
        if not line.startswith(_READY_PREFIX):
            self.close()
            raise RuntimeError(f"test server did not start: {line!r}")
        return line[len(_READY_PREFIX) :].strip()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def port(self) -> int:
        return int(self.url.rstrip("/").rsplit(":", 1)[1])

    def set_faults(self, **changes: Any) -> dict[str, Any]:
        """Change latency or fault rates of the running server."""
        request = urllib.request.Request(
            self.url + "_control", data=json.dumps(changes).encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.load(response)
        return result

    def stats(self) -> dict[str, int]:
        """Counters: requests, max_in_flight, errors, throttles, drops, stalls, ranges,
        not_found."""
        with urllib.request.urlopen(self.url + "_stats", timeout=10) as response:
            result: dict[str, int] = json.load(response)
        return result

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)
        if self._process.stdout is not None:
            self._process.stdout.close()


def _readline_with_timeout(process: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line of output, or '' if it prints nothing in time or dies."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return ""
    return process.stdout.readline()


_NGINX_CONFIG = """
{user}
daemon off;
worker_processes 1;
pid {state}/nginx.pid;
error_log {state}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {state}/body;
    proxy_temp_path {state}/proxy;
    fastcgi_temp_path {state}/fastcgi;
    uwsgi_temp_path {state}/uwsgi;
    scgi_temp_path {state}/scgi;
    server {{
        listen 127.0.0.1:{port} backlog={backlog};
        root {root};
    }}
}}
"""


class Nginx(Closing):
    """nginx serving a folder as plain static files (with Range) on 127.0.0.1; a context
    manager. Needs the `nginx` binary (Debian: nginx-light)."""

    def __init__(self, root: str | os.PathLike[str], state: str | os.PathLike[str]) -> None:
        binary = shutil.which("nginx") or "/usr/sbin/nginx"
        if not os.path.exists(binary):
            raise FileNotFoundError("nginx is not installed (Debian: apt-get install nginx-light)")
        state_dir = Path(state)
        state_dir.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        config = state_dir / "nginx.conf"
        config.write_text(_NGINX_CONFIG.format(
            user="user root;" if os.geteuid() == 0 else "",
            state=state_dir, port=port, backlog=_BACKLOG, root=Path(root).resolve(),
        ))
        self._process = subprocess.Popen(
            [binary, "-c", str(config), "-p", str(state_dir), "-e", str(state_dir / "error.log")]
        )
        self.url = f"http://127.0.0.1:{port}/"
        self._wait_until_listening(port, state_dir)

    def _wait_until_listening(self, port: int, state: Path) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log = (state / "error.log").read_text() if (state / "error.log").exists() else ""
                raise RuntimeError(f"nginx exited with {self._process.returncode}: {log}")
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.05)
        self.close()
        raise RuntimeError(f"nginx did not listen on port {port} within {_START_TIMEOUT} s")

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()  # SIGTERM: nginx's fast shutdown
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
