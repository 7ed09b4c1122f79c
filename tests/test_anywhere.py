"""Decode code works with decode processes wherever a user coming from PyTorch's DataLoader
writes it: a script without `if __name__ == "__main__":`, `python -c`, lambdas, closures,
partials, callable objects and classes of `__main__`, notebook cells, module-level state,
`worker_init`, helper modules found through `sys.path` changes, `os.environ` set by the script.

Each case runs as the user would run it, in a process of its own (a script, `python -c`, a
Jupyter kernel), with two decode processes; its batches must equal those of `num_workers=0`
and hold the right values for every sample, and the user's top-level code must run once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from segments import names

import aioloader
from aioloader.testing import TestServer

from decoders import SAMPLE_COUNT, sample_bytes

RUN_SECONDS = 60
"""The longest a script may run; each takes about a second."""
SEED = 7
BATCH_SIZE = 8
EPOCHS = 3
MARKER = "top level of the script ran"
ZYGOTE_MODULE = "aioloader._processes.zygote_main"
PACKAGE_PARENT = str(Path(aioloader.__file__).resolve().parents[1])


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The scripts import the aioloader these tests import (as the zygote does)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (PACKAGE_PARENT, environment.get("PYTHONPATH")) if p
    )
    environment.update(extra or {})
    return environment


def _left_behind(parent: int) -> list[int]:
    """The zygote and decode processes still running for a process that has ended."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if ZYGOTE_MODULE in command and command[-1:] == [str(parent)]:
            found.append(process.pid)
    return found


def _assert_nothing_left_by(parent: int) -> None:
    deadline = time.monotonic() + 5
    while (left := _left_behind(parent)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes {left} outlived the process {parent} that started them"


def run_python(arguments: list[str], cwd: Path, environment: dict[str, str] | None = None) -> str:
    """Run `python *arguments` as a user would; its stdout. It must exit cleanly, write nothing
    to stderr and leave no decode process behind."""
    with subprocess.Popen(
        [sys.executable, *arguments], cwd=cwd, env=_environment(environment),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=RUN_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate(timeout=RUN_SECONDS)
            pytest.fail(f"python {arguments[0]} ran over {RUN_SECONDS} s:\n{out}\n{err}")
    assert process.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert err == "", err
    _assert_nothing_left_by(process.pid)
    return out


def results(out: str) -> list[Any]:
    """What a script printed as JSON, one value a line."""
    return [json.loads(line) for line in out.splitlines() if line.startswith(("{", "["))]


def write_script(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def expected_value(index: int, epoch: int) -> int:
    """What the scripts' `decode(raw, rng)` gives for a sample: the sum of its bytes after the
    index, plus a number from the per-sample rng (`default_rng([seed, epoch, index])`)."""
    body = np.frombuffer(sample_bytes(index)[4:], np.uint8)
    noise = np.random.default_rng([SEED, epoch, index]).integers(0, 1000)
    return int(body.sum()) + int(noise)


def assert_right_epochs(epochs: list[list[list[list[int]]]]) -> None:
    """Batches of (indices, values): every sample once per epoch, in batches of BATCH_SIZE,
    each with the value its bytes and its rng give; a new order every epoch."""
    assert len(epochs) == EPOCHS
    orders = []
    for epoch, batches in enumerate(epochs):
        indices = [i for batch in batches for i in batch[0]]
        values = [v for batch in batches for v in batch[1]]
        assert sorted(indices) == list(range(SAMPLE_COUNT))
        assert [len(batch[0]) for batch in batches[:-1]] == [BATCH_SIZE] * (len(batches) - 1)
        assert values == [expected_value(i, epoch) for i in indices]
        orders.append(indices)
    assert len({tuple(order) for order in orders}) == EPOCHS


# -- 1 and 2: a script without a main guard, and `python -c` -----------------------------------

UNGUARDED_SCRIPT = f"""\
import json
import sys

import numpy as np

import aioloader

print({MARKER!r}, flush=True)


base, num_workers = sys.argv[1], int(sys.argv[2])


def decode(raw, rng):
    assert (aioloader.get_worker_info() is None) == (num_workers == 0)  # where it runs
    data = np.frombuffer(raw, np.uint8)
    return int.from_bytes(raw[:4], "little"), int(data[4:].sum()) + int(rng.integers(0, 1000))


urls = [f"{{base}}{{i:04d}}.bin" for i in range({SAMPLE_COUNT})]
loader = aioloader.Loader(aioloader.Files(urls), decode=decode, batch_size={BATCH_SIZE},
                          shuffle=True, seed={SEED}, num_workers=num_workers)
for epoch in range({EPOCHS}):
    print(json.dumps([[indices.tolist(), values.tolist()] for indices, values in loader]))
"""


def test_script_without_main_guard_runs_its_top_level_once(
    tmp_path: Path, server: TestServer, leak_check: None
) -> None:
    script = write_script(tmp_path, "train.py", UNGUARDED_SCRIPT)
    with_workers = run_python([str(script), server.url, "2"], tmp_path)
    inline = run_python([str(script), server.url, "0"], tmp_path)
    assert with_workers.count(MARKER) == 1, with_workers
    assert results(with_workers) == results(inline)
    assert_right_epochs(results(with_workers))


def test_decode_defined_in_python_c_works_in_decode_processes(
    tmp_path: Path, sample_dir: Path, leak_check: None
) -> None:
    base = f"{sample_dir}{os.sep}"
    with_workers = run_python(["-c", UNGUARDED_SCRIPT, base, "2"], tmp_path)
    inline = run_python(["-c", UNGUARDED_SCRIPT, base, "0"], tmp_path)
    assert with_workers.count(MARKER) == 1, with_workers
    assert results(with_workers) == results(inline)
    assert_right_epochs(results(with_workers))


# -- 3: lambdas, closures, partials, callable objects, classes of __main__ --------------------

KINDS_SCRIPT = f"""\
import collections
import dataclasses
import functools
import json
import sys
from pathlib import Path

import numpy as np

import aioloader

print({MARKER!r}, flush=True)
paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))


def index_of(raw):
    assert (aioloader.get_worker_info() is None) == (num_workers == 0)  # where it runs
    return int.from_bytes(raw[:4], "little")


def with_lookup_table(table):
    def decode(raw):
        return index_of(raw), int(table[np.frombuffer(raw, np.uint8)].sum())
    return decode


def scaled(raw, rng, scale):
    return index_of(raw), scale * len(raw) + int(rng.integers(0, 10))


class Jitter:
    def __init__(self, amount):
        self.amount = amount

    def __call__(self, raw, rng):
        return index_of(raw), self.amount * float(rng.random())


Sample = collections.namedtuple("Sample", ["index", "head"])


@dataclasses.dataclass
class Record:
    index: int
    head: np.ndarray


def head(raw):
    return np.frombuffer(raw, np.uint8)[4:8].copy()


def stack_records(records):
    return Record(np.array([r.index for r in records]), np.stack([r.head for r in records]))


@dataclasses.dataclass
class Item:
    path: str
    data: bytes


class ScriptDataset(aioloader.Dataset):  # its items are instances of the script's class
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    async def fetch(self, index):
        return Item(self.paths[index], await aioloader.storage.read(self.paths[index]))


def item_size(item):
    assert isinstance(item, Item), type(item)
    return index_of(item.data), len(item.data)


def plain(value):
    \"\"\"JSON for a batch, whatever its type.\"\"\"
    if dataclasses.is_dataclass(value):
        return {{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {{name: plain(getattr(value, name)) for name in value._fields}}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value.item() if isinstance(value, np.generic) else value


LOOKUP = (np.arange(256) * 7919) % 1000
KINDS = {{
    "lambda": (dict(decode=lambda raw: (index_of(raw), len(raw) * 2)), tuple),
    "closure over a numpy table": (dict(decode=with_lookup_table(LOOKUP)), tuple),
    "functools.partial": (dict(decode=functools.partial(scaled, scale=3)), tuple),
    "instance with __call__": (dict(decode=Jitter(0.5)), tuple),
    "namedtuple": (dict(decode=lambda raw: Sample(index_of(raw), head(raw))), Sample),
    "dataclass one by one": (
        dict(decode=lambda raw: Record(index_of(raw), head(raw)), batch_size=None), Record),
    "dataclass with a collate": (
        dict(decode=lambda raw: Record(index_of(raw), head(raw)), collate=stack_records),
        Record),
    "dataset and items of the script": (
        dict(dataset=ScriptDataset(paths), decode=item_size), tuple),
}}
for name, (arguments, expected_class) in KINDS.items():
    runs = {{}}
    for num_workers in (2, 0):
        options = {{"dataset": aioloader.Files(paths), "batch_size": {BATCH_SIZE}, **arguments}}
        loader = aioloader.Loader(shuffle=True, seed={SEED}, num_workers=num_workers, **options)
        batches = list(loader)
        runs[num_workers] = {{
            "batches": plain(batches),
            "classes": sorted({{type(b).__qualname__ for b in batches}}),
            "the script's class": all(type(b) is expected_class for b in batches),
        }}
    print(json.dumps({{"kind": name, "workers": runs[2], "inline": runs[0]}}))
"""
KINDS = [
    "lambda", "closure over a numpy table", "functools.partial", "instance with __call__",
    "namedtuple", "dataclass one by one", "dataclass with a collate",
    "dataset and items of the script",
]


def _indices(kind: str, batches: list[Any]) -> list[int]:
    if kind == "dataclass one by one":
        return [sample["index"] for sample in batches]
    if kind in ("namedtuple", "dataclass with a collate"):
        return [i for batch in batches for i in batch["index"]]
    return [i for batch in batches for i in batch[0]]


def test_lambdas_closures_partials_callables_and_main_classes_work_in_decode_processes(
    tmp_path: Path, sample_dir: Path, leak_check: None
) -> None:
    script = write_script(tmp_path, "kinds.py", KINDS_SCRIPT)
    out = run_python([str(script), str(sample_dir)], tmp_path)
    assert out.count(MARKER) == 1, out
    by_kind = {result["kind"]: result for result in results(out)}
    assert list(by_kind) == KINDS
    for kind, result in by_kind.items():
        workers, inline = result["workers"], result["inline"]
        assert workers == inline, kind
        indices = _indices(kind, workers["batches"])
        assert sorted(indices) == list(range(SAMPLE_COUNT)), kind
        assert workers["the script's class"], (kind, workers["classes"])
    lookup = (np.arange(256) * 7919) % 1000
    closure = by_kind["closure over a numpy table"]["workers"]["batches"]
    for indices, values in closure:
        assert values == [int(lookup[np.frombuffer(sample_bytes(i), np.uint8)].sum())
                          for i in indices]
    records = by_kind["dataclass one by one"]["workers"]["batches"]
    assert all(r["head"] == list(sample_bytes(r["index"])[4:8]) for r in records)
    for kind in ("namedtuple", "dataclass with a collate"):
        for batch in by_kind[kind]["workers"]["batches"]:
            assert list(batch) == ["index", "head"]
            assert batch["head"] == [list(sample_bytes(i)[4:8]) for i in batch["index"]]


# -- 4: a Jupyter notebook ------------------------------------------------------------------


def _batches_digest(batches: list[list[list[int]]]) -> str:
    return hashlib.sha256(json.dumps(batches).encode()).hexdigest()[:16]


NOTEBOOK_CELLS = [
    """\
    import hashlib, json, os
    from pathlib import Path
    import numpy as np
    import aioloader

    with open("top-level-runs.txt", "a") as runs:
        print(os.getpid(), file=runs)
    paths = sorted(str(p) for p in Path({samples!r}).glob("*.bin"))
    print("kernel", os.getpid())""",
    """\
    def decode(raw, rng):
        data = np.frombuffer(raw, np.uint8)
        return int.from_bytes(raw[:4], "little"), int(data[4:].sum()) + int(rng.integers(0, 1000))

    def digest(decode, num_workers):
        loader = aioloader.Loader(aioloader.Files(paths), decode=decode, batch_size={batch},
                                  seed={seed}, num_workers=num_workers)
        batches = [[indices.tolist(), values.tolist()] for indices, values in loader]
        return hashlib.sha256(json.dumps(batches).encode()).hexdigest()[:16]""",
    'print("def", digest(decode, 2), digest(decode, 0))',
    """\
    pids = aioloader.Loader(aioloader.Files(paths[:32]), decode=lambda raw: os.getpid(),
                            batch_size=None, num_workers=2)
    print("decoded-in", *sorted(set(pids)))""",
    """print("lambda", digest(lambda raw: (int.from_bytes(raw[:4], "little"), len(raw) * 3), 2))""",
    """\
    def decode(raw, rng):  # edited and run again
        data = np.frombuffer(raw, np.uint8)
        return int.from_bytes(raw[:4], "little"), int(data[4:].sum()) * 2""",
    'print("edited", digest(decode, 2))',
]


def _kernel_home(folder: Path) -> Path:
    """A `python3` kernelspec for this interpreter, found through JUPYTER_PATH."""
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python",
        "env": {"PYTHONPATH": _environment()["PYTHONPATH"]},
    }))
    return folder


def _jupyter() -> tuple[Any, Any]:
    """nbformat and nbclient (with ipykernel for the kernel): the dev extra has them."""
    try:
        import ipykernel  # noqa: F401
        import nbclient
        import nbformat
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the notebook test needs the dev extra in CI: {e}")
        pytest.skip(f"the notebook test needs nbclient, nbformat and ipykernel: {e}")
    return nbformat, nbclient


def test_notebook_cells_define_decode_functions_for_decode_processes(
    tmp_path: Path, sample_dir: Path, monkeypatch: pytest.MonkeyPatch, leak_check: None
) -> None:
    nbformat, nbclient = _jupyter()
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_home(tmp_path / "jupyter")))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    cells = [textwrap.dedent(cell).format(samples=str(sample_dir), batch=BATCH_SIZE, seed=SEED)
             for cell in NOTEBOOK_CELLS]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=RUN_SECONDS,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    printed = {}
    for cell in notebook.cells:
        for output in cell.outputs:
            assert output["output_type"] == "stream" and output["name"] == "stdout", output
        # one print may come in several stream outputs: the kernel flushes on a timer
        for line in "".join(output["text"] for output in cell.outputs).splitlines():
            first, *rest = line.split()
            printed[first] = rest

    def digest(value: Any) -> str:
        batches = []
        for start in range(0, SAMPLE_COUNT, BATCH_SIZE):
            indices = list(range(start, min(start + BATCH_SIZE, SAMPLE_COUNT)))
            batches.append([indices, [value(i) for i in indices]])
        return _batches_digest(batches)

    body_sum = [int(np.frombuffer(sample_bytes(i)[4:], np.uint8).sum())
                for i in range(SAMPLE_COUNT)]
    with_rng = digest(lambda i: body_sum[i] + int(
        np.random.default_rng([SEED, 0, i]).integers(0, 1000)))
    assert printed["def"] == [with_rng, with_rng]
    assert printed["lambda"] == [digest(lambda i: len(sample_bytes(i)) * 3)]
    assert printed["edited"] == [digest(lambda i: body_sum[i] * 2)]
    kernel = printed["kernel"][0]
    assert 1 <= len(printed["decoded-in"]) <= 2 and kernel not in printed["decoded-in"]
    assert (tmp_path / "top-level-runs.txt").read_text().split() == [kernel]
    _assert_nothing_left_by(int(kernel))



LIVE_LOADER_CELL = """\
import os
import aioloader
paths = sorted(os.path.join({samples!r}, name) for name in os.listdir({samples!r}))[:64]
loader = aioloader.Loader(aioloader.Files(paths), batch_size=8, num_workers=1,
                          decode=lambda raw: len(raw))
batches = iter(loader)
next(batches)  # a pass left running, as an interrupted cell leaves it
print(os.getpid())
"""


def test_a_kernel_with_a_live_loader_shuts_down_at_once_and_leaves_nothing(
    tmp_path: Path, sample_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's shutdown waits for its children to go, and the zygote, ended by the
    kernel's SIGTERM, stayed a zombie until the kernel's exit reaped it."""
    _jupyter()
    from jupyter_client.manager import KernelManager

    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_home(tmp_path / "jupyter")))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=RUN_SECONDS)
        printed: list[str] = []
        reply = client.execute_interactive(
            LIVE_LOADER_CELL.format(samples=str(sample_dir)), timeout=RUN_SECONDS,
            output_hook=lambda message: printed.append(message["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        kernel = int("".join(printed).split()[0])
        started = time.monotonic()
        manager.shutdown_kernel(now=False)
        took = time.monotonic() - started
    finally:
        client.stop_channels()
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
    print(f"a kernel with a live Loader shut down in {took:.2f} s")
    assert took < 2.0  # 0.4 s here; 2.6 s while the zygote stayed a zombie
    _assert_nothing_left_by(kernel)
    assert not names()  # and its blocks went with its processes: they are never named


# -- 5: module-level state a decode mutates ------------------------------------------------

STATE_SCRIPT = f"""\
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import aioloader

print({MARKER!r}, flush=True)
paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))
num_workers, persistent = int(sys.argv[2]), sys.argv[3] == "persistent"

CALLS = 0
HEADERS = {{}}  # a per-process cache: key -> decoded header


def decode(raw):
    global CALLS
    CALLS += 1
    key = raw[4] % 4
    if key not in HEADERS:
        HEADERS[key] = np.full(4, key)
    time.sleep(0.002)  # long enough that both processes get work
    return int.from_bytes(raw[:4], "little"), os.getpid(), CALLS, len(HEADERS)


loader = aioloader.Loader(aioloader.Files(paths), decode=decode, batch_size={BATCH_SIZE},
                          num_workers=num_workers, persistent_workers=persistent)
for epoch in range(2):
    print(json.dumps([[column.tolist() for column in batch] for batch in loader]))
print(json.dumps({{"pid": os.getpid(), "calls": CALLS, "cached": len(HEADERS)}}))
"""


def _calls_by_process(batches: list[list[list[int]]]) -> dict[int, list[int]]:
    calls: dict[int, list[int]] = defaultdict(list)
    for _, pids, counts, cached in batches:
        for pid, count, size in zip(pids, counts, cached, strict=True):
            calls[pid].append(count)
            assert 1 <= size <= 4
    return calls


def test_module_level_state_a_decode_mutates_is_each_decode_process_own(
    tmp_path: Path, sample_dir: Path, leak_check: None
) -> None:
    script = write_script(tmp_path, "state.py", STATE_SCRIPT)
    runs = {mode: results(run_python([str(script), str(sample_dir), workers, mode], tmp_path))
            for mode, workers in (("fresh", "2"), ("persistent", "2"), ("inline", "0"))}
    for mode, (*epochs, _) in runs.items():
        for epoch, (batches, inline) in enumerate(zip(epochs, runs["inline"][:2], strict=True)):
            assert [b[0] for b in batches] == [b[0] for b in inline], (mode, epoch)
    inline_epochs, inline_main = runs["inline"][:2], runs["inline"][2]
    assert inline_main == {"pid": inline_main["pid"], "calls": 2 * SAMPLE_COUNT, "cached": 4}
    assert all(set(b[1]) == {inline_main["pid"]} for e in inline_epochs for b in e)

    # as with DataLoader: each process counts its own calls from the state the main process
    # had (0), the main process's state is untouched, and fresh processes start each epoch
    *fresh, main = runs["fresh"]
    assert main["calls"] == 0 and main["cached"] == 0
    pids_per_epoch = []
    for batches in fresh:
        calls = _calls_by_process(batches)
        assert main["pid"] not in calls and len(calls) <= 2
        for counts in calls.values():
            assert sorted(counts) == list(range(1, len(counts) + 1))
        assert max(len(counts) for counts in calls.values()) > BATCH_SIZE  # kept between tasks
        pids_per_epoch.append(set(calls))
    assert not pids_per_epoch[0] & pids_per_epoch[1]

    # persistent_workers=True: the same processes, their state carried into the next epoch
    *persistent, main = runs["persistent"]
    assert main["calls"] == 0 and main["cached"] == 0
    calls = _calls_by_process(persistent[0] + persistent[1])
    assert main["pid"] not in calls and len(calls) <= 2  # both epochs
    for counts in calls.values():
        assert sorted(counts) == list(range(1, len(counts) + 1))
    assert sum(len(counts) for counts in calls.values()) == 2 * SAMPLE_COUNT


# -- 6: worker_init defined in __main__ -----------------------------------------------------

WORKER_INIT_SCRIPT = f"""\
import json
import os
import sys
from pathlib import Path

import aioloader

print({MARKER!r}, flush=True)
paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))


def worker_init(worker_id):
    info = aioloader.get_worker_info()
    # a file of its own: a line printed to stdout could land inside the script's long lines
    record = Path(sys.argv[3]) / f"init-{{os.getpid()}}"
    record.write_text(f"worker_init {{worker_id}} {{info.id}} {{info.num_workers}} {{os.getpid()}}")


def decode(raw):
    return int.from_bytes(raw[:4], "little"), aioloader.get_worker_info().id, os.getpid()


loader = aioloader.Loader(aioloader.Files(paths), decode=decode, batch_size={BATCH_SIZE},
                          num_workers=2, worker_init=worker_init,
                          persistent_workers=sys.argv[2] == "persistent")
for epoch in range({EPOCHS}):
    print(json.dumps([[column.tolist() for column in batch] for batch in loader]))
"""


def _worker_inits(folder: Path) -> list[tuple[int, int]]:
    """(worker id, pid) of each worker_init call, checking what get_worker_info() said."""
    calls = []
    for record in folder.glob("init-*"):
        line = record.read_text()
        if line.startswith("worker_init "):
            worker_id, info_id, num_workers, pid = map(int, line.split()[1:])
            assert info_id == worker_id and num_workers == 2, line
            calls.append((worker_id, pid))
    return calls


@pytest.mark.parametrize(("mode", "processes"), [("fresh", 2 * EPOCHS), ("persistent", 2)])
def test_worker_init_from_an_unguarded_script_runs_once_per_decode_process(
    tmp_path: Path, sample_dir: Path, leak_check: None, mode: str, processes: int
) -> None:
    script = write_script(tmp_path, "init.py", WORKER_INIT_SCRIPT)
    records = tmp_path / "inits"
    records.mkdir()
    out = run_python([str(script), str(sample_dir), mode, str(records)], tmp_path)
    assert out.count(MARKER) == 1, out
    inits = _worker_inits(records)
    assert len(inits) == processes
    worker_of = dict((pid, worker_id) for worker_id, pid in inits)
    assert len(worker_of) == processes  # once per process
    assert sorted(worker_id for worker_id, _ in inits) == sorted([0, 1] * (processes // 2))
    epochs = results(out)
    assert len(epochs) == EPOCHS
    for batches in epochs:
        assert sorted(i for batch in batches for i in batch[0]) == list(range(SAMPLE_COUNT))
        for _, worker_ids, pids in batches:
            assert all(worker_of[pid] == w for pid, w in zip(pids, worker_ids, strict=True))


WORKER_INIT_STATE_SCRIPT = """\
import json
import sys
from pathlib import Path

import aioloader

paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))[:4]
CONNECTION = None  # opened once per decode process, as with DataLoader's worker_init_fn
SETTINGS = {}


def worker_init(worker_id):
    global CONNECTION
    CONNECTION = f"connection {worker_id}"
    SETTINGS["worker"] = worker_id


def decode(raw):
    return f"{CONNECTION} {SETTINGS.get('worker')}"


loader = aioloader.Loader(aioloader.Files(paths), decode=decode, batch_size=None,
                          num_workers=2, worker_init=worker_init)
print(json.dumps(sorted(set(loader))))
"""


def test_state_worker_init_sets_in_main_globals_is_seen_by_decode(
    tmp_path: Path, sample_dir: Path
) -> None:
    script = write_script(tmp_path, "init_state.py", WORKER_INIT_STATE_SCRIPT)
    out = run_python([str(script), str(sample_dir)], tmp_path)
    seen = set(results(out)[0])
    assert seen <= {"connection 0 0", "connection 1 1"} and seen, seen


# -- 7: helper modules found through the script's sys.path changes ----------------------------

HELPER_MODULE = """\
import numpy as np


def index_of(raw):
    return int.from_bytes(raw[:4], "little")


def decode(raw, rng):
    return index_of(raw), int(np.frombuffer(raw, np.uint8)[4:].sum()) + int(rng.integers(0, 1000))
"""

NOISE_MODULE = """\
def noise(rng):
    return int(rng.integers(0, 1000))
"""

SYS_PATH_SCRIPT = f"""\
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent / "libs"))  # absolute
sys.path.append("vendored")  # relative to the working directory

import aioloader
import sample_helpers
import noise_helpers

print({MARKER!r}, flush=True)
paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))


def decode(raw, rng):
    assert (aioloader.get_worker_info() is None) == (num_workers == 0)  # where it runs
    body = np.frombuffer(raw, np.uint8)[4:]
    return sample_helpers.index_of(raw), int(body.sum()) + noise_helpers.noise(rng)


for decode_function in (decode, sample_helpers.decode):
    for num_workers in (2, 0):
        loader = aioloader.Loader(aioloader.Files(paths), decode=decode_function,
                                  batch_size={BATCH_SIZE}, shuffle=True, seed={SEED},
                                  num_workers=num_workers)
        for epoch in range({EPOCHS}):
            print(json.dumps([[indices.tolist(), values.tolist()] for indices, values in loader]))
"""


def test_decode_finds_modules_through_the_scripts_sys_path_changes(
    tmp_path: Path, sample_dir: Path, leak_check: None
) -> None:
    project = tmp_path / "project"
    (project / "libs").mkdir(parents=True)
    (project / "vendored").mkdir()
    (project / "libs" / "sample_helpers.py").write_text(HELPER_MODULE)
    (project / "vendored" / "noise_helpers.py").write_text(NOISE_MODULE)
    script = write_script(project, "train.py", SYS_PATH_SCRIPT)
    out = run_python([str(script), str(sample_dir)], project)
    assert out.count(MARKER) == 1, out
    runs = results(out)
    assert len(runs) == 4 * EPOCHS
    for start in range(0, len(runs), 2 * EPOCHS):
        with_workers, inline = runs[start:start + EPOCHS], runs[start + EPOCHS:start + 2 * EPOCHS]
        assert with_workers == inline
        assert_right_epochs(with_workers)


# -- 8: os.environ set by the script ---------------------------------------------------------

ENVIRON_SCRIPT = f"""\
import json
import os
import sys
from pathlib import Path

import aioloader

print({MARKER!r}, flush=True)
paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))
num_workers = int(sys.argv[2])


def decode(raw):
    assert (aioloader.get_worker_info() is None) == (num_workers == 0)  # where it runs
    return (int.from_bytes(raw[:4], "little"), int(os.environ["AIOLOADER_TEST_OFFSET"]),
            os.environ.get("AIOLOADER_TEST_REMOVED", "removed"))


def epoch(loader):
    samples, offsets, removed = 0, set(), set()
    for indices, offset, gone in loader:
        samples += len(indices)
        offsets.update(offset.tolist())
        removed.update(gone)
    return {{"offsets": sorted(offsets), "removed": sorted(removed), "samples": samples}}


del os.environ["AIOLOADER_TEST_REMOVED"]
os.environ["AIOLOADER_TEST_OFFSET"] = "100"
loader = aioloader.Loader(aioloader.Files(paths), decode=decode, batch_size={BATCH_SIZE},
                          num_workers=num_workers)
print(json.dumps(epoch(loader)))
os.environ["AIOLOADER_TEST_OFFSET"] = "200"  # the decode processes of the next pass see it
print(json.dumps(epoch(loader)))
os.environ["AIOLOADER_TEST_OFFSET"] = "300"
again = aioloader.Loader(aioloader.Files(paths), decode=decode, batch_size={BATCH_SIZE},
                         num_workers=num_workers)
print(json.dumps(epoch(again)))
"""


def test_decode_sees_environment_variables_the_script_set(
    tmp_path: Path, sample_dir: Path, leak_check: None
) -> None:
    script = write_script(tmp_path, "environ.py", ENVIRON_SCRIPT)
    launched_with = {"AIOLOADER_TEST_REMOVED": "set when the script started"}
    with_workers = run_python([str(script), str(sample_dir), "2"], tmp_path, launched_with)
    inline = run_python([str(script), str(sample_dir), "0"], tmp_path, launched_with)
    assert with_workers.count(MARKER) == 1, with_workers
    assert results(with_workers) == results(inline) == [
        {"offsets": [offset], "removed": ["removed"], "samples": SAMPLE_COUNT}
        for offset in (100, 200, 300)
    ]


WARNINGS_SCRIPT = f"""\
import json
import sys
import warnings
from pathlib import Path

import aiohttp.web  # adds a filter on aiohttp.web_exceptions.NotAppKeyWarning

import aioloader

print({MARKER!r}, flush=True)
paths = sorted(str(p) for p in Path(sys.argv[1]).glob("*.bin"))


class DataWarning(UserWarning):  # a class of __main__: the filter takes it by value
    pass


warnings.filterwarnings("error", message="made by decode", category=UserWarning)
warnings.filterwarnings("error", message="main", category=DataWarning)
warnings.simplefilter("error", (FutureWarning, DataWarning))  # a tuple: warnings matches it


def raises(message, category):
    try:
        warnings.warn(message, category)
    except category:
        return True
    return False


def decode(raw):
    raised = (raises("made by decode", UserWarning) and raises("main", DataWarning)
              and raises("tuple", FutureWarning))
    return raised, any(name.startswith("aiohttp.") for name in sys.modules)  # not a name
    # of a module: the preload would take it for one the decode processes need


loader = aioloader.Loader(aioloader.Files(paths[:4]), decode=decode, batch_size=4,
                          num_workers=1)
for raised, imported in loader:
    print(json.dumps({{"raised": raised.tolist(), "aiohttp": imported.tolist()}}))
"""


def test_decode_processes_take_the_scripts_warning_filters_without_importing_their_packages(
    tmp_path: Path, sample_dir: Path, leak_check: None
) -> None:
    """A filter on a warning class of a package the decode processes have not imported (here
    aiohttp's, which `aiohttp.web` adds) would, unpickled, import that package in each of them
    (0.15 s for aiohttp, before the first chunk); it is left out there, the others apply."""
    script = write_script(tmp_path, "warnings_filters.py", WARNINGS_SCRIPT)
    out = run_python([str(script), str(sample_dir)], tmp_path)
    assert results(out) == [{"raised": [True] * 4, "aiohttp": [False] * 4}]


# -- an iterator left open when the script ends ------------------------------------------------

OPEN_ITERATOR_SCRIPT = """\
import sys

import aioloader
from aioloader._tools.images import decode_and_augment

paths = sys.argv[1:]
loader = aioloader.Loader(aioloader.Files(paths, [0] * len(paths)), decode=decode_and_augment,
                          batch_size=64, num_workers=2, shuffle=True)
batches = iter(loader)
print(len(next(batches)["label"]))
"""


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Enough JPEGs that decode processes are still at work when a script stops early."""
    pytest.importorskip("PIL")
    from aioloader._tools.images import make_images

    folder = tmp_path_factory.mktemp("photos")
    return [str(folder / name) for name, _ in make_images(folder, 640, dimensions=(500, 375))]


@pytest.mark.parametrize("closed", [True, False], ids=["loader closed", "loader left open"])
def test_an_iterator_left_open_at_exit_prints_nothing(
    tmp_path: Path, photos: list[str], closed: bool
) -> None:
    """`batches = iter(loader); next(batches)`, then the script ends (after `loader.close()`
    or not) with decode processes still at work: no "Exception ignored" from the iterator
    collected at interpreter exit, and no process left behind."""
    source = OPEN_ITERATOR_SCRIPT + ("loader.close()\n" if closed else "")
    assert run_python(["-c", source, *photos], tmp_path) == "64\n"
