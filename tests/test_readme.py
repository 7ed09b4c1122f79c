"""Every ```python block of README.md runs as a user would paste it.

Each block runs in a fresh interpreter (`python -c`), in a folder holding the files the blocks
name (`0000.bin`, `train.rec`, `train.tfrecord`, `shards/`, the Parquet files, the corpus),
with the README's `http://127.0.0.1:8000/` (as `aioloader serve DIR --port 8000` serves a
folder) pointed at a test server over that same folder, and `s3://bucket/` at moto's S3
server. A block passes when it exits with status 0 and prints no traceback.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from segments import names

from aioloader._tools.images import make_images
from aioloader._tools.packing import list_items, pack_recordio, pack_tfrecord
from aioloader.testing import TestServer

README = Path(__file__).resolve().parent.parent / "README.md"
README_URL = "http://127.0.0.1:8000/"
BLOCK_TIMEOUT = 120

SAMPLES = 100
SAMPLE_SIZE = 64
IMAGES = 48
SHARDS = 4
PARQUET_FILES = 4
ROW_GROUPS = 3
ROWS_PER_GROUP = 100
CORPUS_FILES = 4
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wizards", "quietly", "hex", "jolly"]

NEEDS = {"import torch": "torch", "s3://": "obstore", "aioloader.Parquet": "pyarrow"}
"""Optional extras a block needs, by what its text contains."""


@dataclass(frozen=True)
class Block:
    line: int
    """Where the block's code starts in README.md (1-based)."""
    code: str

    @property
    def title(self) -> str:
        """The block's first line that is neither an import nor a comment: what it shows."""
        for text in self.code.splitlines():
            text = text.split("  #")[0].strip()
            if text and not text.startswith(("#", "import ", "from ")):
                return text[:60]
        return f"line {self.line}"


def readme_blocks() -> list[Block]:
    blocks, code, start = [], None, 0
    for number, text in enumerate(README.read_text().splitlines(), 1):
        if code is None:
            if text.strip() == "```python":
                code, start = [], number + 1
        elif text.strip() == "```":
            blocks.append(Block(start, "\n".join(code) + "\n"))
            code = None
        else:
            code.append(text)
    assert code is None, f"README.md: the ```python block at line {start} is never closed"
    return blocks


BLOCKS = readme_blocks()


def test_the_readme_has_python_blocks_to_run() -> None:
    """A change of fence (```py, ```Python) would silently leave blocks untested."""
    assert len(BLOCKS) >= 9
    fences = re.findall(r"^```(\w+)", README.read_text(), flags=re.MULTILINE)
    assert set(fences) <= {"python", "sh"}, f"fences this test does not know: {set(fences)}"


def sample(index: int) -> bytes:
    """SAMPLE_SIZE bytes of UTF-8 source code: every sample the same size (the Usage block
    stacks them raw) and text (the mixture block decodes them)."""
    line = f"def f{index:04d}(x): return x * {index} + {index % 7}  # sample {index}"
    return line.ljust(SAMPLE_SIZE - 1).encode() + b"\n"


def write_tar_shards(images: Path, shards: Path) -> None:
    """WebDataset shards train-000000.tar ...: per sample KEY.jpg and KEY.cls (its class)."""
    shards.mkdir()
    items = list_items(images)
    for shard in range(SHARDS):
        with tarfile.open(shards / f"train-{shard:06d}.tar", "w") as tar:
            for item in items[shard::SHARDS]:
                for extension, payload in (
                    ("jpg", item.path.read_bytes()),
                    ("cls", str(int(item.labels[0])).encode()),
                ):
                    info = tarfile.TarInfo(f"{item.index:06d}.{extension}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))


def write_parquet(folder: Path) -> None:
    """train-0000.parquet ...: columns text (a few words) and label, a few row groups each."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = ROW_GROUPS * ROWS_PER_GROUP
    for part in range(PARQUET_FILES):
        numbers = range(part * rows, (part + 1) * rows)
        texts = [" ".join(WORDS[(n + k) % len(WORDS)] for k in range(3 + n % 20)) for n in numbers]
        table = pa.table({"text": texts, "label": [n % 10 for n in numbers]})
        pq.write_table(table, folder / f"train-{part:04d}.parquet", row_group_size=ROWS_PER_GROUP)


@pytest.fixture(scope="session")
def readme_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the README's blocks name, in one folder: the blocks' working directory and
    what the test server serves."""
    pytest.importorskip("PIL")
    folder = tmp_path_factory.mktemp("readme")
    for i in range(SAMPLES):
        (folder / f"{i:04d}.bin").write_bytes(sample(i))
    make_images(folder / "images", IMAGES, dimensions=(64, 48), by_class=True)
    pack_recordio(folder / "images", folder / "train.rec", processes=1)
    pack_tfrecord(folder / "images", folder / "train.tfrecord", processes=1)
    write_tar_shards(folder / "images", folder / "shards")
    write_parquet(folder)
    for part in range(CORPUS_FILES):
        text = " ".join(WORDS[(part + k) % len(WORDS)] for k in range(400))
        (folder / f"corpus-{part:03d}.txt").write_text(text + "\n")
    return folder


@pytest.fixture(scope="session")
def readme_server(readme_data: Path) -> Iterator[TestServer]:
    with TestServer(readme_data) as running:
        yield running


@pytest.fixture(scope="session")
def readme_bucket(s3_endpoint: str, readme_data: Path) -> str:
    """Bucket `bucket` on moto's S3 server, with the samples under samples/."""
    boto3 = pytest.importorskip("boto3")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="bucket")
    for i in range(SAMPLES):
        name = f"{i:04d}.bin"
        body = (readme_data / name).read_bytes()
        client.put_object(Bucket="bucket", Key=f"samples/{name}", Body=body)
    return "s3://bucket/"


def session_members(session: int) -> list[str]:
    """The processes of this session still running: what a block left behind."""
    members = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(OSError):
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                members.append(f"{process.pid} {' '.join(process.info['cmdline'] or [])}")
    return members


@dataclass
class Run:
    status: int | None
    """None: still running after BLOCK_TIMEOUT seconds."""
    stdout: str
    stderr: str
    left_behind: list[str]


def run_block(block: Block, folder: Path, server_url: str) -> Run:
    """The block as pasted into `python -c`, in `folder`, in a session of its own (its decode
    processes with it), with this process's environment."""
    code = block.code.replace(README_URL, server_url)
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=folder,
        env=os.environ.copy(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return Run(None, stdout, stderr, [])
    deadline = time.monotonic() + 5  # the README: all gone within a second of the main process
    while (left := session_members(process.pid) + names()) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return Run(process.returncode, stdout, stderr, left)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.title)
def test_readme_block_runs_as_pasted(
    block: Block, readme_data: Path, readme_server: TestServer, request: pytest.FixtureRequest
) -> None:
    """Exits with status 0, prints no traceback (not even one ignored at exit), and leaves no
    process or shared-memory segment behind."""
    for marker, module in NEEDS.items():
        if marker in block.code:
            pytest.importorskip(module)
    if "s3://" in block.code:
        request.getfixturevalue("readme_bucket")
    run = run_block(block, readme_data, readme_server.url)
    outcome = (
        f"still running after {BLOCK_TIMEOUT} s"
        if run.status is None
        else f"exit status {run.status}"
    )
    report = (
        f"README.md line {block.line}: {outcome}\n"
        f"--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    )
    assert run.status == 0, report
    assert "Traceback" not in run.stderr, report
    assert not run.left_behind, f"README.md line {block.line} left behind: {run.left_behind}"
