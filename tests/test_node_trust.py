"""The node service's rendezvous trusts no one it has not checked: a place another user can
change is passed over, a squatted name costs the job nothing, and a rank refuses a listener of
another user before it sends a byte. The other user is real: uid 65534."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aioloader
from aioloader._service import rendezvous as node

from decoders import index_of

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second user")


def _found(caplog: pytest.LogCaptureFixture) -> node.Folder:
    with caplog.at_level(logging.WARNING, "aioloader"):
        folder = node.private_directory()
    os.close(folder.descriptor)
    return folder


@pytest.mark.parametrize("hostile", ["others may write", "another user's"])
def test_a_runtime_dir_another_user_can_change_is_passed_over(
    hostile: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`su` or `sudo -E` hand root another user's XDG_RUNTIME_DIR; a shared scratch folder is
    writable by all: whoever can rename in it could swap our folder for theirs."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    if hostile == "others may write":
        runtime.chmod(0o777)
    else:
        os.chown(runtime, NOBODY, NOBODY)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    folder = _found(caplog)
    assert runtime not in folder.path.parents
    assert f"node sockets not under {runtime}" in caplog.text


@pytest.mark.parametrize("squat", ["folder", "symlink"])
def test_a_squatted_folder_name_costs_the_job_nothing(
    squat: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, local_paths: list[str],
) -> None:
    """Another user made our folder's name first (where they could: a temporary folder): the
    ranks walk to the next name, all alike, and the job runs."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    theirs = runtime / f"aioloader-{os.getuid()}"
    if squat == "folder":
        theirs.mkdir(mode=0o777)
        os.chown(theirs, NOBODY, NOBODY)
    else:
        target = tmp_path / "their-folder"
        target.mkdir(mode=0o700)
        os.chown(target, NOBODY, NOBODY)
        theirs.symlink_to(target)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert _found(caplog).path == runtime / f"aioloader-{os.getuid()}-1"
    assert f"node sockets not in {theirs}" in caplog.text
    with aioloader.Loader(aioloader.Files(local_paths[:8]), decode=index_of, batch_size=4,
                          num_workers=1, service="node") as loader:
        assert [list(batch) for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


LISTENER = """
import os, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
os.chdir(os.path.dirname(sys.argv[1]))   # a short path to bind
sock.bind(os.path.basename(sys.argv[1]))  # as root, in root's folder: the squatter's best case
os.setuid(int(sys.argv[2]))
sock.listen(4)                     # SO_PEERCRED reports who listened: the other user
print("listening", flush=True)
sock.settimeout(20)
peer, _ = sock.accept()
peer.settimeout(5)
got = 0
try:
    while chunk := peer.recv(1 << 16):
        got += len(chunk)
except OSError:
    pass
print(got, flush=True)
"""


def test_a_rank_refuses_a_listener_of_another_user_and_sends_it_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before this check, a swapped folder's listener got the rank's first message (its
    whole environment) and answered with a pickle the rank unpickled."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    folder = node.private_directory()
    os.close(folder.descriptor)
    path = folder.path / f"{node.socket_name('f' * 64)}.sock"
    listener = subprocess.Popen([sys.executable, "-c", LISTENER, str(path), str(NOBODY)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None
        assert listener.stdout.readline().strip() == "listening"
        with pytest.raises(aioloader.LoaderError, match=f"of user {NOBODY}.*nothing sent"):
            node.connect(b"configuration", "f" * 64, [], stall_timeout=5)
        out, _ = listener.communicate(timeout=30)
        assert out.strip() == "0", "the listener received bytes"
    finally:
        listener.kill()
        listener.wait()


# -- sharing by content: what each rank's decode will run --------------------------------------

VARIANTS = {
    "a global": ("decode", "SIZE = {v}\ndef decode(raw):\n    return raw * SIZE\n"),
    "a global dict": ("decode", "OPTIONS = {{'size': {v}}}\n"
                                "def decode(raw):\n    return raw * OPTIONS['size']\n"),
    "a global helper with other code": ("decode", "def helper(raw):\n    return raw + {v}\n"
                                                  "def decode(raw):\n    return helper(raw)\n"),
    "a class attribute": ("decode", "class Decode:\n    size = {v}\n"
                                    "    def __call__(self, raw):\n        return raw * self.size\n"
                                    "decode = Decode()\n"),
    "a __call__ body": ("decode", "class Decode:\n    def __call__(self, raw):\n"
                                  "        return raw * {v}\ndecode = Decode()\n"),
    "a collate global": ("collate", "import numpy\nSCALE = {v}\n"
                                    "def collate(items):\n    return numpy.array(items) * SCALE\n"),
    "a worker_init global": ("worker_init", "SEED = {v}\n"
                                            "def worker_init(worker_id):\n    return SEED\n"),
}


def _node_fingerprint(role: str, source: str, value: int, paths: list[str]) -> str:
    """The fingerprint ranks meet by, for a Loader whose `role` function is defined in a
    script's `__main__` (sent by value) with `value` in it."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(source.format(v=value), namespace)
    loader = aioloader.Loader(aioloader.Files(paths), batch_size=2, service="node",
                              **{role: namespace[role]})
    fingerprint = loader._service.fingerprint
    loader.close()
    return fingerprint


@pytest.mark.parametrize("difference", sorted(VARIANTS))
def test_loaders_that_differ_in_what_decode_reads_get_different_services(
    difference: str, local_paths: list[str]
) -> None:
    role, source = VARIANTS[difference]
    first = _node_fingerprint(role, source, 1, local_paths[:4])
    assert first == _node_fingerprint(role, source, 1, local_paths[:4])
    assert first != _node_fingerprint(role, source, 1000, local_paths[:4])


RANK_WITH_A_GLOBAL = """
import sys
sys.path.insert(0, {tests!r})
import aioloader
from decoders import index_of

SCALE = int(sys.argv[1])


def decode(raw):
    return index_of(raw) * SCALE


loader = aioloader.Loader(aioloader.Files({paths!r}), decode=decode, batch_size=4,
                          num_workers=1, service="node", rank=int(sys.argv[2]), world_size=2)
with loader:
    print(sorted(int(i) for batch in loader for i in batch), flush=True)
"""


def test_ranks_whose_decode_reads_a_global_that_differs_each_get_their_own_data(
    local_paths: list[str], tmp_path: Path
) -> None:
    """One job, two ranks, a global that depends on the rank (`args.size`): rank 1 got rank
    0's decode, [8..15] instead of [8000..15000], without a word."""
    script = RANK_WITH_A_GLOBAL.format(tests=str(Path(__file__).parent), paths=local_paths[:16])
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                   "TORCHELASTIC_RUN_ID": tmp_path.name}
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(scale), str(rank)],
                              stdout=subprocess.PIPE, text=True, env=environment)
             for rank, scale in ((0, 1), (1, 1000))]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    got = [eval(output) for output in outputs]
    assert got[0] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert got[1] == [4000, 5000, 6000, 7000, 12000, 13000, 14000, 15000]


# -- what ended jobs leave in the folder ----------------------------------------------------------

KILLED_JOB = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import aioloader
from decoders import index_of
loader = aioloader.Loader(aioloader.Files({paths!r}), decode=index_of, batch_size=4,
                          num_workers=1, service="node")
next(iter(loader))
os.kill(loader._service._client.pid, signal.SIGKILL)  # the service, then this rank: a job killed
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_jobs_socket_lock_and_empty_log_are_swept_and_a_finished_jobs_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_paths: list[str]
) -> None:
    """Lock files piled up, one per job, and a SIGKILLed service left its socket and log."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    folder = runtime / f"aioloader-{os.getuid()}"
    script = KILLED_JOB.format(tests=str(Path(__file__).parent), paths=local_paths[:16])
    subprocess.run([sys.executable, "-c", script], timeout=120,
                   env={**os.environ, "TORCHELASTIC_RUN_ID": "killed"})
    left = sorted(entry.suffix for entry in folder.iterdir())
    assert ".sock" in left, f"the killed job left {left}"
    with aioloader.Loader(aioloader.Files(local_paths[:8]), decode=index_of, batch_size=4,
                          num_workers=1, service="node") as loader:
        assert [list(batch) for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    deadline = time.monotonic() + 20  # the service ends once its last rank left
    while list(folder.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(folder.iterdir()) == []
