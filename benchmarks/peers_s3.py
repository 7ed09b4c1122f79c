"""The S3 side of benchmarks/peers.py: moto's S3 server behind a proxy that adds latency and
counts requests.

moto costs about 3 ms of CPU per GET, which on 2 cores would cap a one-object-per-sample loader
at moto's rate rather than its own. So the proxy answers GETs (Range GETs too) of the object
bodies it was told about itself, from the local files that were uploaded, and forwards the rest
(listing, HEAD, PUT, multipart, anything unknown) to moto. Every answer waits `latency_ms`
before its first byte; a fraction `tail_rate` waits `tail_seconds` more. Counters, by method and
by path prefix (/bucket/first-folder), are read with GET /__proxy/stats.

    python benchmarks/peers_s3.py --upstream http://127.0.0.1:PORT [--latency-ms 20]

prints `listening on PORT` once it serves. The benchmark starts it itself.
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

CONTROL = "/__proxy"
RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-encoding", "host",
              "content-length"}
PRESIGNED = {"x-id", "AWSAccessKeyId", "Signature", "Expires"}
"""Query parameters of a plain GET besides X-Amz-* (SigV4 presigning): botocore's `x-id` and
SigV2 presigning."""
READ_INLINE = 1 << 20
"""Bodies up to this size are read in the event loop; larger ones in a thread."""
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class Known:
    """An uploaded object whose body the proxy serves itself."""

    path: str
    size: int
    etag: str
    last_modified: str


def prefix_of(request: web.Request) -> str:
    """`/bucket/first-folder` of the path; for a bucket listing, of its `prefix` parameter."""
    parts = request.path.strip("/").split("/")
    if len(parts) == 1:
        listed = parse_qs(request.query_string).get("prefix", [""])[0].strip("/")
        parts += [listed.split("/")[0]] if listed else []
    return "/" + "/".join(parts[:2])


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a Range header, or None for the whole body; ValueError if the
    range can't be satisfied."""
    if not header:
        return None
    match = RANGE.match(header.strip())
    if match is None:
        return None  # S3 ignores a Range it can't parse
    first, last = match.groups()
    if not first:
        start, end = max(0, size - int(last or 0)), size
    else:
        start, end = int(first), size if not last else min(size, int(last) + 1)
    if start >= size or start >= end:
        raise ValueError(f"bytes {start}-{end} of {size}")
    return start, end


def plain_get(parameters: Iterable[str]) -> bool:
    """A GET of the object's body: no parameters, or only those of a presigned URL and
    botocore's `x-id` (not a part number, version, ACL, tagging...)."""
    return all(p in PRESIGNED or p.lower().startswith("x-amz-") for p in parameters)


def read_slice(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(start)
        return file.read(end - start)


class Proxy:
    """The aiohttp application: latency, counters, local bodies, everything else to moto."""

    def __init__(self, upstream: str, latency_ms: float, tail_rate: float, tail_seconds: float,
                 seed: int = 0) -> None:
        self.upstream = upstream.rstrip("/")
        self.latency = latency_ms / 1000
        self.tail_rate = tail_rate
        self.tail_seconds = tail_seconds
        self.random = random.Random(seed)
        self.known: dict[str, Known] = {}
        self.counts: Counter[str] = Counter()
        self.session: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get(f"{CONTROL}/stats", self.stats)
        app.router.add_post(f"{CONTROL}/register", self.register)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self.start_session)
        app.on_cleanup.append(self.close_session)
        return app

    async def start_session(self, _: web.Application) -> None:
        self.session = ClientSession(connector=TCPConnector(limit=64), auto_decompress=False,
                                     timeout=ClientTimeout(total=600))

    async def close_session(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def stats(self, _: web.Request) -> web.Response:
        return web.json_response(dict(self.counts))

    async def register(self, request: web.Request) -> web.Response:
        """Body: a JSON list of {"bucket", "key", "path", "etag"} for objects just uploaded."""
        for entry in await request.json():
            stat = os.stat(entry["path"])
            self.known[f"/{entry['bucket']}/{entry['key']}"] = Known(
                entry["path"], stat.st_size, entry["etag"],
                email.utils.formatdate(stat.st_mtime, usegmt=True))
        return web.json_response({"known": len(self.known)})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        prefix = prefix_of(request)
        self.counts[f"{request.method} {prefix}"] += 1
        await self.wait()
        known = self.known.get(request.path) if request.method == "GET" else None
        if known is not None and plain_get(request.query.keys()):
            response = await self.serve(request, known)
        else:
            self.counts[f"forwarded {prefix}"] += 1
            response = await self.forward(request)
        if request.method != "HEAD":
            self.counts[f"bytes {prefix}"] += response.content_length or 0
        return response

    async def wait(self) -> None:
        """First-byte latency, and now and then a much longer one (a slow tail)."""
        delay = self.latency
        if self.tail_rate and self.random.random() < self.tail_rate:
            delay += self.tail_seconds
        if delay:
            await asyncio.sleep(delay)

    async def serve(self, request: web.Request, known: Known) -> web.Response:
        """A GET answered from the uploaded file, with S3's headers (the ETag moto gave)."""
        headers = {"ETag": known.etag, "Last-Modified": known.last_modified,
                   "Accept-Ranges": "bytes", "Content-Type": "binary/octet-stream"}
        try:
            window = byte_range(request.headers.get("Range"), known.size)
        except ValueError:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{known.size}"},
                                body=b"<Error><Code>InvalidRange</Code></Error>")
        start, end = window or (0, known.size)
        if end - start <= READ_INLINE:
            body = read_slice(known.path, start, end)
        else:
            body = await asyncio.to_thread(read_slice, known.path, start, end)
        if window is None:
            return web.Response(body=body, headers=headers)
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{known.size}"
        return web.Response(status=206, body=body, headers=headers)

    async def forward(self, request: web.Request) -> web.Response:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["Host"] = request.host  # as the client signed it
        async with self.session.request(
            request.method, self.upstream + request.path_qs, headers=headers,
            data=await request.read() if request.can_read_body else None,
            allow_redirects=False,
        ) as upstream:
            body = await upstream.read()
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            if request.method == "HEAD" and "Content-Length" in upstream.headers:
                response = web.Response(status=upstream.status, headers=kept)
                response.headers["Content-Length"] = upstream.headers["Content-Length"]
                return response
            return web.Response(status=upstream.status, headers=kept, body=body)


def serve_forever(upstream: str, latency_ms: float, tail_rate: float, tail_seconds: float) -> None:
    """Serve on a free port of 127.0.0.1 and say which on stdout."""
    proxy = Proxy(upstream, latency_ms, tail_rate, tail_seconds)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    print(f"listening on {listener.getsockname()[1]}", flush=True)
    web.run_app(proxy.app(), sock=listener, print=None, access_log=None, backlog=4096)


# --- the benchmark's side: start both servers, upload, read counters ---


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[Any], what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.1)


class Servers:
    """moto and the proxy, each in its own process on 127.0.0.1; `endpoint` is the proxy's."""

    def __init__(self, latency_ms: float, tail_rate: float, tail_seconds: float) -> None:
        self.moto_port = free_port()
        self.moto = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proxy: subprocess.Popen[str] | None = None
        try:
            wait_for_port(self.moto_port, self.moto, "moto's S3 server")
            self.proxy = subprocess.Popen(
                [sys.executable, __file__, "--upstream", self.moto_url,
                 "--latency-ms", str(latency_ms), "--tail-rate", str(tail_rate),
                 "--tail-seconds", str(tail_seconds)],
                stdout=subprocess.PIPE, text=True)
            assert self.proxy.stdout is not None
            line = self.proxy.stdout.readline()
            if not line.startswith("listening on "):
                raise RuntimeError("the proxy did not start")
            self.endpoint = f"http://127.0.0.1:{int(line.split()[-1])}"
        except BaseException:
            self.close()
            raise

    @property
    def moto_url(self) -> str:
        return f"http://127.0.0.1:{self.moto_port}"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in (self.moto, self.proxy) if p is not None]

    def environment(self) -> dict[str, str]:
        """What a loader's process needs to reach the bucket through the proxy."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def close(self) -> None:
        for process in (self.proxy, self.moto):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(10)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class PerProcessS3:
    """The S3 side of a map-style dataset as a PyTorch user writes it: a boto3 client made
    lazily in each process (a forked worker must not share its parent's connections);
    credentials from the environment."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        self.endpoint, self.bucket = endpoint, bucket
        self._client: Any = None
        self._pid = 0

    def client(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            import boto3

            self._client, self._pid = boto3.client("s3", endpoint_url=self.endpoint), os.getpid()
        return self._client


def read_stats(endpoint: str) -> Counter[str]:
    with urllib.request.urlopen(f"{endpoint}{CONTROL}/stats", timeout=30) as response:
        return Counter(json.load(response))


def upload(servers: Servers, bucket: str, objects: Iterable[tuple[str, Path]]) -> int:
    """put_object each (key, file) to moto directly (no latency), then tell the proxy where
    each body lies. Single-part uploads, so moto's ETag is the body's MD5."""
    import boto3

    client = boto3.client("s3", endpoint_url=servers.moto_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    existing = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)

    def put(item: tuple[str, Path]) -> dict[str, str]:
        key, path = item
        answer = client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        return {"bucket": bucket, "key": key, "path": str(path), "etag": answer["ETag"]}

    with ThreadPoolExecutor(8) as pool:
        entries = list(pool.map(put, objects))
    for start in range(0, len(entries), 2000):
        request = urllib.request.Request(
            f"{servers.endpoint}{CONTROL}/register", method="POST",
            data=json.dumps(entries[start:start + 2000]).encode(),
            headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=60).close()
    return len(entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--tail-rate", type=float, default=0.0)
    parser.add_argument("--tail-seconds", type=float, default=1.0)
    args = parser.parse_args()
    serve_forever(args.upstream, args.latency_ms, args.tail_rate, args.tail_seconds)


if __name__ == "__main__":
    main()
