"""Real HTTP servers for tests, the demo and benchmarks: the project's own, over a directory,
with injectable latency and faults; and nginx, for plain static files.

`TestServer` starts the project's server in its own process on 127.0.0.1 with a free port (also
`aioloader serve DIR --latency-ms 20` from a shell); faults can be changed while it runs
(POST /_control, JSON, with the server's control token in the X-Control-Token header) and its
counters read (GET /_stats). Files carry an ETag and Last-Modified and If-Range is honoured,
so a test may replace a file between a client's requests. Paths under /_hostile/ misbehave on
purpose, for tests of a client's defences (see `_FaultyFileServer.hostile`).

`FaultyProxy` puts the same faults in front of any HTTP server on loopback (an object-store
emulator, a TestServer, nginx): it forwards every request and answers in its own process, with
the same control and counters. `Nginx` starts nginx the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import functools
import gzip
import hmac
import json
import math
import os
import random
import re
import secrets
import selectors
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import zlib
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ._closing import Closing

__all__ = [
    "CONTROL_HEADER",
    "CONTROL_TOKEN_VARIABLE",
    "Faults",
    "FaultyProxy",
    "Nginx",
    "TestServer",
    "serve",
    "serve_proxy",
]

CONTROL_HEADER = "X-Control-Token"
"""POST /_control must carry the server's control token in this header."""
CONTROL_TOKEN_VARIABLE = "AIOLOADER_CONTROL_TOKEN"
"""The server takes its control token from this environment variable (not the command line,
which other users of the machine can read); without it, it makes one and prints it."""

_READY_PREFIX = "serving "
_START_TIMEOUT = 30.0
_BACKLOG = 4096
"""Room for hundreds of clients connecting at once (the default 128 drops SYNs: 1 s stalls)."""
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
_HUGE_SIZE = 100 * 10**9
_BOMB_SIZE = 1 << 30
_CHUNK = 1 << 18
_PATTERN = bytes(range(251)) * (_CHUNK // 251 + 2)
"""/_hostile/endless and /_hostile/huge send byte i = i % 251, cut from this."""


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
    ignore_ranges: bool = False
    """Range headers ignored: 200 and the whole file, as Python's http.server answers."""
    shift_ranges: int = 0
    """206 answers start this many bytes after the range asked (their Content-Range says so)."""
    content_encoding: str = ""
    """Sent as Content-Encoding with every file; gzip and deflate also encode the body (of a
    206 too, which makes no sense: that is the point), other values only label it."""
    no_etag: bool = False
    """Files sent without an ETag, with Last-Modified only (as Python's http.server)."""

    def __post_init__(self) -> None:
        """Bad settings fail here, where they are made, not as a 500 on every later request."""
        for field in dataclasses.fields(self):
            test, what = _RATE if field.name.endswith("_rate") else _RULES[str(field.type)]
            value = getattr(self, field.name)
            if not test(value):
                raise ValueError(f"{field.name} must be {what}, got {value!r}")


def _is_number(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "float": (_is_number, "a number >= 0"),
    "float | None": (lambda v: v is None or _is_number(v), "a number >= 0 or null"),
    "int": (lambda v: type(v) is int, "an integer"),
    "bool": (lambda v: type(v) is bool, "true or false"),
    "str": (lambda v: type(v) is str, "a string"),
}
"""What each type of `Faults` field accepts (JSON's true is no number, 1 is no bool)."""
_RATE = (lambda v: _is_number(v) and v <= 1, "a number from 0 to 1")


class _Faulty:
    """What the file server and the proxy share: the faults, the roll that picks one for each
    request, the misbehaviours, the counters, /_control and /_stats. A subclass says how to
    answer honestly (`answer`) and routes its requests to `handle`."""

    def __init__(self, faults: Faults, control_token: str) -> None:
        self.faults = self.check(faults)
        self.random = random.Random(faults.seed)
        self.counts: Counter[str] = Counter()
        self.in_flight = 0
        self.control_token = control_token.encode()

    @staticmethod
    def check(faults: Faults) -> Faults:
        """`faults`, or a ValueError naming settings this server cannot apply (refused, not
        silently ignored); the file server applies them all."""
        return faults

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/_control", self.control)
        app.router.add_get("/_stats", self.stats)
        return app

    async def control(self, request: web.Request) -> web.Response:
        """Change faults: only with the token (a web page cannot send it, nor JSON without
        asking first), and only to valid settings; a refused change leaves the faults as they
        were."""
        token = request.headers.get(CONTROL_HEADER, "").encode(errors="surrogateescape")
        if not hmac.compare_digest(token, self.control_token):
            return web.Response(status=403, text=f"{CONTROL_HEADER} is missing or wrong\n")
        if request.content_type != "application/json":
            return web.Response(status=415, text="send Content-Type: application/json\n")
        try:
            changes = json.loads(await request.read())
            if not isinstance(changes, dict):
                raise ValueError("send a JSON object of fault settings")
            unknown = set(changes) - {f.name for f in dataclasses.fields(Faults)}
            if unknown:
                raise ValueError(f"unknown fault settings: {', '.join(sorted(unknown))}")
            self.faults = self.check(dataclasses.replace(self.faults, **changes))
        except ValueError as e:  # a JSONDecodeError or UnicodeDecodeError too
            return web.Response(status=400, text=f"{e}\n")
        if "seed" in changes:
            self.random = random.Random(self.faults.seed)
        return web.json_response(dataclasses.asdict(self.faults))

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(dict(self.counts))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.counts["requests"] += 1
        self.in_flight += 1
        self.counts["max_in_flight"] = max(self.counts["max_in_flight"], self.in_flight)
        try:
            return await self._handle(request)
        finally:
            self.in_flight -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
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
        return await self.answer(request, cut=False)

    async def _misbehave(self, fault: str, request: web.Request) -> web.StreamResponse:
        if fault == "errors":
            retry_after = self.faults.retry_after
            headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
            return web.Response(status=503, text="injected fault", headers=headers)
        if fault == "throttles":
            return web.Response(status=429, text="slow down", headers={"Retry-After": "0"})
        if fault == "stalls":
            await asyncio.sleep(self.faults.stall_seconds)
            return await self.answer(request, cut=False)
        return await self.answer(request, cut=True)

    async def answer(self, request: web.Request, cut: bool) -> web.StreamResponse:
        """The honest answer; with `cut`, sent through `_send` to be cut mid-body."""
        raise NotImplementedError


async def _send(
    request: web.Request, response: web.StreamResponse, chunks: AsyncIterable[bytes], cut: bool
) -> web.StreamResponse:
    """Send `response` with its body from `chunks` as they come. With `cut`, a 2xx that
    announces its length stops after half of its body and the connection closes: what a reset
    mid-body looks like to a client. Other answers go whole (an unknown length has no half)."""
    length = response.content_length
    left = length // 2 if cut and length and response.status < 300 else None
    await response.prepare(request)
    async for chunk in chunks:
        if left is not None and len(chunk) >= left:
            await response.write(chunk[:left])
            if request.transport is not None:
                request.transport.close()
            return response
        await response.write(chunk)
        if left is not None:
            left -= len(chunk)
    await response.write_eof()
    return response


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


class _FaultyFileServer(_Faulty):
    def __init__(self, root: Path, faults: Faults, control_token: str) -> None:
        super().__init__(faults, control_token)
        self.root = root.resolve()

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/_hostile/{name}", self.hostile)
        app.router.add_get("/{path:.*}", self.handle)
        return app

    async def answer(self, request: web.Request, cut: bool) -> web.StreamResponse:
        answer = self._answer(request)
        if not cut or answer.body is None:
            return answer
        body = bytes(answer.body)  # type: ignore[arg-type]
        response = web.StreamResponse(status=answer.status, headers=answer.headers)
        response.content_length = len(body)
        return await _send(request, response, _once(body), cut=True)

    def _answer(self, request: web.Request) -> web.Response:
        path = (self.root / request.match_info["path"]).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            self.counts["not_found"] += 1
            return web.Response(status=404, text=f"no such file: {request.path}")
        stat = path.stat()
        size = stat.st_size
        validators = {"Last-Modified": email.utils.formatdate(stat.st_mtime, usegmt=True)}
        if not self.faults.no_etag:  # a new file (inode), a write (mtime), a new size
            validators["ETag"] = f'"{stat.st_ino:x}-{stat.st_mtime_ns:x}-{size:x}"'
        match = _RANGE.match(request.headers.get("Range", ""))
        if_range = request.headers.get("If-Range")
        if (
            not match
            or self.faults.ignore_ranges
            or (if_range is not None and if_range not in validators.values())
        ):  # If-Range naming another version: the whole file as it is now
            return self._encoded(200, path.read_bytes(), {"Accept-Ranges": "bytes", **validators})
        first_text, last_text = match.groups()
        if first_text:
            first, last = int(first_text), min(int(last_text or size - 1), size - 1)
        else:
            first, last = max(0, size - int(last_text)), size - 1
        if first >= size or first > last:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        self.counts["ranges"] += 1
        shift = self.faults.shift_ranges
        first, last = min(first + shift, size - 1), min(last + shift, size - 1)
        with path.open("rb") as f:
            f.seek(first)
            body = f.read(last - first + 1)
        headers = {"Content-Range": f"bytes {first}-{last}/{size}", "Accept-Ranges": "bytes",
                   **validators}
        return self._encoded(206, body, headers)

    def _encoded(self, status: int, body: bytes, headers: dict[str, str]) -> web.Response:
        """The answer with the Content-Encoding the faults ask for; gzip and deflate encode."""
        encoding = self.faults.content_encoding
        if encoding:
            headers["Content-Encoding"] = encoding
        if encoding == "gzip":
            body = gzip.compress(body)
        elif encoding == "deflate":
            body = zlib.compress(body)
        return web.Response(status=status, body=body, headers=headers)

    async def hostile(self, request: web.Request) -> web.StreamResponse:
        """What no honest server sends, for tests of a client's defences:

        - /_hostile/endless: 200 and bytes without end (no Content-Length);
        - /_hostile/huge: 200 announcing 100 GB whatever Range asks, then bytes until the
          client hangs up (byte i of both is i % 251);
        - /_hostile/loop: a redirect to itself;
        - /_hostile/bomb: 1 GiB of zeros, gzip-encoded into about 5 MB.
        """
        name = request.match_info["name"]
        self.counts[f"hostile_{name}"] += 1
        if name == "loop":
            return web.Response(status=302, headers={"Location": request.path})
        if name == "bomb":
            bomb = await asyncio.to_thread(_gzip_bomb)
            return web.Response(body=bomb, headers={"Content-Encoding": "gzip"})
        if name not in ("endless", "huge"):
            return web.Response(status=404, text=f"no such hostile path: {request.path}")
        response = web.StreamResponse()
        end = 1 << 62  # as good as endless
        if name == "huge":
            response.content_length = end = _HUGE_SIZE
        await response.prepare(request)
        sent = 0
        with contextlib.suppress(ConnectionError):  # the client hung up: what we wait for
            while sent < end:
                chunk = _PATTERN[sent % 251 : sent % 251 + min(_CHUNK, end - sent)]
                await response.write(chunk)
                sent += len(chunk)
        return response


@functools.cache
def _gzip_bomb() -> bytes:
    packer = zlib.compressobj(1, wbits=31)
    zeros = bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(_BOMB_SIZE >> 20)) + packer.flush()


_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
    "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "expect",  # Expect: 100-continue is for the proxy's own server, which answers it
})
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_FILE_FAULTS = ("ignore_ranges", "shift_ranges", "content_encoding", "no_etag")
"""Faults of the files a TestServer serves, which a proxy, passing answers on, cannot apply."""


def _end_to_end(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """The headers a proxy passes on, repeated ones too: all but the hop-by-hop ones and those
    the Connection header names."""
    named = {token.strip().lower() for value in headers.getall("Connection", ())
             for token in value.split(",")}
    return CIMultiDict((name, value) for name, value in headers.items()
                       if name.lower() not in _HOP_BY_HOP and name.lower() not in named)


def _loopback(upstream: str) -> str:
    """`upstream` without its trailing /, if it is http:// on this machine's loopback: a test
    proxy never reaches out."""
    parts = urllib.parse.urlsplit(upstream)
    if parts.scheme != "http" or parts.hostname not in _LOOPBACK or parts.query or parts.fragment:
        raise ValueError(
            f"a fault proxy forwards only to http:// on loopback ({', '.join(_LOOPBACK)}), "
            f"without a query: {upstream!r} is not"
        )
    return upstream.rstrip("/")


class _FaultyProxy(_Faulty):
    """Forwards every request but /_control and /_stats to the upstream and the faults to the
    answers. The Host header goes on as the client sent it, naming the proxy: a client signs
    (AWS SigV4) the host it talks to, and addresses the upstream builds from Host (a
    Location, an upload URL) lead back through the proxy. Bodies stream both ways."""

    def __init__(
        self, upstream: str, client: aiohttp.ClientSession, faults: Faults, control_token: str
    ) -> None:
        super().__init__(faults, control_token)
        self.upstream = _loopback(upstream)
        self.client = client

    @staticmethod
    def check(faults: Faults) -> Faults:
        refused = [field.name for field in dataclasses.fields(Faults)
                   if field.name in _FILE_FAULTS and getattr(faults, field.name) != field.default]
        if refused:
            raise ValueError(f"a proxy passes answers on as they come: it cannot apply "
                             f"{', '.join(refused)} (faults of a TestServer's files)")
        return faults

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_route("*", "/{path:.*}", self.handle)
        return app

    async def answer(self, request: web.Request, cut: bool) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        try:
            async with self.client.request(
                request.method, URL(self.upstream + request.raw_path, encoded=True),
                headers=_end_to_end(request.headers),
                data=request.content if request.body_exists else None, allow_redirects=False,
            ) as upstream:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                              headers=_end_to_end(upstream.headers))
                return await _send(request, response, upstream.content.iter_any(), cut)
        except (ConnectionError, aiohttp.ClientError) as e:
            if response is not None and response.prepared:
                # either side broke off mid-body: the client must not wait for the rest
                if request.transport is not None:
                    request.transport.close()
                return response
            self.counts["upstream_failures"] += 1
            return web.Response(
                status=502, text=f"proxy to {self.upstream}: {type(e).__name__}: {e}\n"
            )


async def serve(
    root: Path, host: str, port: int, faults: Faults, control_token: str | None = None
) -> None:
    """Serve until cancelled; prints one line `serving http://HOST:PORT/` once listening.

    POST /_control needs `control_token` (default: the CONTROL_TOKEN_VARIABLE environment
    variable; without it a random one, printed on a second line) in the CONTROL_HEADER header.
    """
    token, made = _control_token(control_token)
    await _listen(_FaultyFileServer(root, faults, token), host, port, token if made else None)


async def serve_proxy(
    upstream: str, host: str, port: int, faults: Faults, control_token: str | None = None
) -> None:
    """Forward to `upstream` (http:// on loopback) until cancelled, with faults; prints and
    takes its token as `serve` does."""
    token, made = _control_token(control_token)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=_START_TIMEOUT)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout, auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"),
    ) as client:  # adds no header of its own: Azure's Shared Key signs Content-Type
        server = _FaultyProxy(upstream, client, faults, token)
        await _listen(server, host, port, token if made else None)


def _control_token(given: str | None) -> tuple[str, bool]:
    """The control token (given, else from the environment, else a new one) and whether it is
    new, so that it must be printed."""
    token = given or os.environ.get(CONTROL_TOKEN_VARIABLE) or ""
    return token or secrets.token_urlsafe(24), not token


async def _listen(server: _Faulty, host: str, port: int, new_token: str | None) -> None:
    """Serve until cancelled; print the ready line, and `new_token` if there is one."""
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=_BACKLOG, reuse_address=True)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        print(f"{_READY_PREFIX}http://{bound_host}:{bound_port}/", flush=True)
        if new_token:
            print(f"control token (send as {CONTROL_HEADER} to POST /_control): {new_token}",
                  flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


class _ServerProcess(Closing):
    """One of this module's servers in a child process on 127.0.0.1, with a control token of
    its own; a context manager."""

    def __init__(self, command: list[str]) -> None:
        self.control_token = secrets.token_urlsafe(24)
        environment = {**os.environ, CONTROL_TOKEN_VARIABLE: self.control_token}
        self._process = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env=environment
        )
        self.url = self._wait_until_ready()

    def _wait_until_ready(self) -> str:
        assert self._process.stdout is not None
        line = _readline_with_timeout(self._process, _START_TIMEOUT)
        if not line.startswith(_READY_PREFIX):
            self.close()
            raise RuntimeError(f"{type(self).__name__} did not start: {line!r}")
        return line[len(_READY_PREFIX) :].strip()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def port(self) -> int:
        return int(self.url.rstrip("/").rsplit(":", 1)[1])

    def set_faults(self, **changes: Any) -> dict[str, Any]:
        """Change latency or fault rates of the running server; a bad setting raises the
        server's 400 (urllib.error.HTTPError) and changes nothing."""
        request = urllib.request.Request(
            self.url + "_control",
            data=json.dumps(changes).encode(),
            method="POST",
            headers={"Content-Type": "application/json", CONTROL_HEADER: self.control_token},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.load(response)
        return result

    def stats(self) -> dict[str, int]:
        """Counters: requests, max_in_flight, errors, throttles, drops, stalls, and the
        server's own (see its class)."""
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


class TestServer(_ServerProcess):
    """The fault-injecting file server in a child process on 127.0.0.1; a context manager.
    Its own counters: ranges, not_found, and hostile_NAME per request to /_hostile/NAME."""

    __test__ = False  # not a pytest test class

    def __init__(self, root: str | os.PathLike[str], port: int = 0, **faults: Any) -> None:
        """`port` 0 picks a free one; give the old port to restart a server in place."""
        options = Faults(**faults)
        command = [sys.executable, "-m", "aioloader", "serve", str(root), "--port", str(port)]
        for field in dataclasses.fields(options):
            value = getattr(options, field.name)
            if value is not None and value is not False:
                flag = f"--{field.name.replace('_', '-')}"
                command += [flag] if value is True else [flag, str(value)]
        super().__init__(command)


class FaultyProxy(_ServerProcess):
    """A reverse proxy in a child process on 127.0.0.1 that forwards every request (any
    method, path, query, body; headers but the hop-by-hop ones) to `upstream`, an http:// base
    URL on loopback (else a ValueError), and puts `Faults` on the answers: latency, 503s that
    never reach the upstream, 429s, stalls, and drops that cut a 2xx after half of its body.
    The Host header goes on unchanged (it names the proxy, the host a client signs); bodies
    and ranges pass as they come. /_control and /_stats are the proxy's own. A context
    manager. Its own counter: upstream_failures (502s: the upstream did not answer)."""

    def __init__(self, upstream: str, port: int = 0, **faults: Any) -> None:
        """`port` 0 picks a free one. The faults of a TestServer's files (ignore_ranges,
        shift_ranges, content_encoding, no_etag) are refused with a ValueError."""
        self.upstream = _loopback(upstream)
        options = json.dumps(dataclasses.asdict(_FaultyProxy.check(Faults(**faults))))
        super().__init__([sys.executable, "-m", __name__, self.upstream, str(port), options])


def _proxy_main(upstream: str, port: str, faults: str) -> None:
    """The process a FaultyProxy starts: `python -m aioloader.testing UPSTREAM PORT FAULTS`,
    the faults as a JSON object."""
    asyncio.run(serve_proxy(upstream, "127.0.0.1", int(port), Faults(**json.loads(faults))))


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


if __name__ == "__main__":
    _proxy_main(*sys.argv[1:])
