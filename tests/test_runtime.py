"""The runtime's lifecycle with real processes and signals: passes after a break, one pass at a
time, closing from another thread, the main process's death, deadlines, the stall watchdog,
recovery from dead decode processes, a /dev/shm too small for the batches, joins off the loop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from segments import blocks, names

import aioloader
from aioloader._ipc import shm
from aioloader.testing import TestServer

from conftest import ended
from decoders import (
    SAMPLE_COUNT,
    die_on_five,
    faults_reusing_buffers,
    index_and_noise,
    index_and_pid,
    slow_index,
    stuck_on_five,
)

TESTS = Path(__file__).resolve().parent


def decode_processes() -> list[psutil.Process]:
    """This interpreter's decode processes: the children of its zygote named so (its other
    children are loader services)."""
    zygotes = [p for p in psutil.Process().children()
               if "aioloader._processes.zygote_main" in " ".join(p.cmdline())]
    return [p for zygote in zygotes for p in zygote.children() if p.name() == "aioloader-dec"]


def wait_until(condition: object, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(condition())  # type: ignore[operator]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_decode_processes_keep_freed_buffers_for_reuse(local_paths: list[str]) -> None:
    """A fresh process's malloc maps and unmaps large buffers and trims its heap after each
    batch: a page fault per 4 KiB of every decoded image. Decode processes start with the
    thresholds a long run ends up with (about 16,000 faults a round without)."""
    loader = aioloader.Loader(aioloader.Files(local_paths[:4]), decode=faults_reusing_buffers,
                              batch_size=None, num_workers=2)
    with loader:
        faults = [int(f) for f in loader]
    assert max(faults) < 1000, faults


# -- passes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [False, True])
async def test_passes_started_right_after_a_break_all_decode_in_processes_and_finish(
    local_paths: list[str], persistent: bool, leak_check: None
) -> None:
    me = os.getpid()
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=index_and_pid, batch_size=8,
                              persistent_workers=persistent)
    async with loader:
        for _ in range(5):
            async for _, pids in loader:
                assert me not in pids.tolist()
                break
            for _, pids in loader:
                assert me not in pids.tolist()
                break
        batches = [batch async for batch in loader]
    assert sorted(int(i) for indices, _ in batches for i in indices) == list(range(SAMPLE_COUNT))
    assert me not in {int(p) for _, pids in batches for p in pids}


def test_a_second_pass_while_one_runs_raises_at_once(local_paths: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=slow_index, batch_size=4)
    with loader:
        first = iter(loader)
        next(first)
        refused: list[str] = []

        def second() -> None:
            try:
                next(iter(loader))
            except aioloader.LoaderError as e:
                refused.append(str(e))

        other = threading.Thread(target=second)
        other.start()
        other.join(30)
        assert refused and "already running" in refused[0]
        assert len(list(first)) == len(loader) - 1  # the first pass goes on undisturbed
    assert loader.epoch == 1


async def test_a_second_async_pass_in_another_task_raises_at_once(local_paths: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=slow_index, batch_size=4)
    async with loader:
        first = aiter(loader)
        await anext(first)

        async def second() -> None:
            async for _ in loader:
                pass

        with pytest.raises(aioloader.LoaderError, match="already running"):
            await asyncio.wait_for(second(), 30)
        assert len([b async for b in first]) == len(loader) - 1


def test_close_from_another_thread_ends_the_pass_and_leaves_nothing(
    urls: list[str], leak_check: None
) -> None:
    loader = aioloader.Loader(aioloader.Files(urls * 20), decode=slow_index, batch_size=4)
    iterator = iter(loader)
    next(iterator)
    closed_at: list[float] = []

    def close() -> None:
        closed_at.append(time.monotonic())
        loader.close()

    closer = threading.Timer(0.3, close)
    closer.start()
    with pytest.raises(aioloader.LoaderError, match="closed"):
        for _ in iterator:
            pass
    raised_at = time.monotonic()
    closer.join(30)
    assert raised_at - closed_at[0] < 5  # the contract's bound on a hang, not a speed figure
    with pytest.raises(aioloader.LoaderError, match="closed"):
        list(loader)


# -- the main process's death --------------------------------------------------------------------

PARENT_SCRIPT = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import numpy as np
import aioloader
from decoders import big_image

paths = {paths!r}
loader = aioloader.Loader(aioloader.Files(paths), decode=big_image, batch_size=10,
                          persistent_workers=True)
cache = aioloader.SharedCache(0.01)
cache.attach(10)
cache.put(1, np.arange(3))
named = aioloader.SharedCache(0.01, name={name!r})
named.attach(10)
batches = iter(loader)
kept = [next(batches), next(batches)]
print(json.dumps({{"pid": os.getpid()}}), flush=True)
time.sleep(120)
"""


def test_sigkill_of_the_main_process_leaves_no_process_and_no_shared_memory(
    local_paths: list[str], tmp_path: Path
) -> None:
    name = f"orphan-{os.getpid()}"
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT.format(tests=str(TESTS), paths=local_paths, name=name))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = json.loads(parent.stdout.readline())["pid"]
        family = psutil.Process(pid).children(recursive=True)
        assert len(family) >= 3  # the zygote and two decode processes
        made = set(blocks([pid, *(p.pid for p in family)]))
        assert made  # batch blocks and the unnamed cache
        assert any(f"-cache-{name}-" in n for n in os.listdir(shm.SHM_DIR))
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        def all_gone() -> bool:
            alive = [p for p in family if not ended(p)]
            left = made & set(blocks()) or [n for n in names() if f"-cache-{name}-" in n]
            return not alive and not left

        assert wait_until(all_gone, 10), "decode processes or segments outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()


# -- deadlines and the watchdog -----------------------------------------------------------------


def test_decode_timeout_names_the_samples_and_kills_the_stuck_process(
    local_paths: list[str], leak_check: None
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=stuck_on_five, batch_size=4,
                              decode_timeout=1)
    with pytest.raises(aioloader.DecodeTimeoutError) as caught:
        list(loader)
    message = str(caught.value)
    assert "samples [4, 5, 6, 7]" in message and "decode_timeout=1" in message
    pid = int(re.search(r"pid (\d+)", message).group(1))  # type: ignore[union-attr]
    assert wait_until(lambda: ended(pid), 10)


def test_decode_timeout_with_skip_drops_only_the_stuck_batch(local_paths: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=stuck_on_five, batch_size=4,
                              decode_timeout=1, on_error="skip")
    with loader:
        seen = [int(i) for batch in loader for i in batch]
    assert seen == [i for i in range(SAMPLE_COUNT) if i not in (4, 5, 6, 7)]
    assert loader.stats.skipped == 4 and loader.stats.decode_timeouts == 1
    assert all("decode_timeout" in r for r in loader.stats.skip_reasons)


def test_a_stopped_decode_process_raises_stall_error_naming_it(local_paths: list[str]) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths * 3), decode=slow_index,
                              batch_size=4, stall_timeout=2)
    with loader:
        iterator = iter(loader)
        next(iterator)
        stopped = decode_processes()
        for process in stopped:
            process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(aioloader.StallError, match=r"decode process \d \(pid \d+\)"):
                for _ in iterator:
                    pass
        finally:
            for process in stopped:
                if process.is_running():
                    process.send_signal(signal.SIGCONT)


def test_a_read_that_never_answers_raises_stall_error_naming_the_url(
    faulty_server: TestServer,
) -> None:
    faulty_server.set_faults(stall_rate=1.0, stall_seconds=300)
    urls = [f"{faulty_server.url}{i:04d}.bin" for i in range(8)]
    loader = aioloader.Loader(aioloader.Files(urls), batch_size=4, num_workers=0, timeout=300,
                              stall_timeout=1)
    with pytest.raises(aioloader.StallError, match=r"read of sample \d \(http://.*\.bin\)"):
        list(loader)


# -- recovery -----------------------------------------------------------------------------------


def reference_batches(paths: list[str]) -> list[dict[str, np.ndarray]]:
    with aioloader.Loader(aioloader.Files(paths), decode=index_and_noise, batch_size=4,
                          shuffle=True, seed=7, num_workers=0) as loader:
        return list(loader)


def test_a_killed_decode_process_is_replaced_and_the_epoch_is_unchanged(
    local_paths: list[str],
) -> None:
    reference = reference_batches(local_paths)
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=index_and_noise,
                              batch_size=4, shuffle=True, seed=7, prefetch=1)
    got = []
    with loader, pytest.warns(RuntimeWarning, match="SIGKILL"):
        for n, batch in enumerate(loader):
            got.append(batch)
            if n == 3:
                for process in decode_processes():  # as the OOM killer would
                    process.send_signal(signal.SIGKILL)
    assert loader.stats.worker_restarts >= 2
    assert len(got) == len(reference)
    for mine, theirs in zip(got, reference, strict=True):
        np.testing.assert_array_equal(mine["index"], theirs["index"])
        np.testing.assert_array_equal(mine["noise"], theirs["noise"])


def test_deaths_past_max_worker_restarts_raise_worker_died_error(
    local_paths: list[str], leak_check: None
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths * 5), decode=slow_index, batch_size=4,
                              max_worker_restarts=0)
    with pytest.raises(aioloader.WorkerDiedError, match="max_worker_restarts"), loader:
        for n, _ in enumerate(loader):
            if n == 2:
                decode_processes()[0].send_signal(signal.SIGKILL)


def test_samples_that_kill_a_process_twice_are_named_and_not_sent_again(
    local_paths: list[str],
) -> None:
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=die_on_five, batch_size=4)
    with pytest.raises(aioloader.WorkerDiedError, match=r"samples \[4, 5, 6, 7\] killed"), \
            pytest.warns(RuntimeWarning, match="SIGKILL"):
        list(loader)
    loader = aioloader.Loader(aioloader.Files(local_paths), decode=die_on_five, batch_size=4,
                              on_error="skip")
    with loader, pytest.warns(RuntimeWarning, match="SIGKILL"):
        seen = [int(i) for batch in loader for i in batch]
    assert seen == [i for i in range(SAMPLE_COUNT) if i not in (4, 5, 6, 7)]


# -- a small /dev/shm ---------------------------------------------------------------------------

SMALL_SHM_SCRIPT = """
import sys, warnings
sys.path.insert(0, {tests!r})
import numpy as np
import aioloader

def big(raw):
    index = int.from_bytes(raw[:4], "little")
    return np.full((3, 224, 224), index, np.float32)   # 600 KB a sample, 38 MB a batch of 64

paths = {paths!r}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with aioloader.Loader(aioloader.Files(paths * 3), decode=big, batch_size=64) as loader:
        total = 0
        for batch in loader:
            assert (batch[:, 0, 0, 0] == batch[:, 1, 2, 3]).all()
            total += len(batch)
print("samples", total)
print("transport", loader.stats.transport)
print("warned", [str(w.message) for w in caught if "memory" in str(w.message)][:1])
try:
    aioloader.SharedCache(1, name="too-big")
except ValueError as e:
    print("cache refused:", e)
"""


def in_small_shm(script: Path, megabytes: int) -> subprocess.CompletedProcess[str]:
    command = (f"mount -t tmpfs -o size={megabytes}m tmpfs /dev/shm && "
               f"exec {sys.executable} {script}")
    return subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True,
                          text=True, timeout=120)


def test_batches_larger_than_a_small_dev_shm_still_come_shared(
    local_paths: list[str], tmp_path: Path
) -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a private /dev/shm")
    """Docker gives a container 64 MiB of /dev/shm: blocks are not there (memory by
    descriptor), so batches of 38 MiB, three decoding at once, still come shared; only a named
    cache lives in /dev/shm, and one that does not fit is refused with the way out."""
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM_SCRIPT.format(tests=str(TESTS), paths=local_paths))
    done = in_small_shm(script, 64)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"samples {3 * SAMPLE_COUNT}" in done.stdout
    transport = json.loads(re.search(r"transport (.*)", done.stdout)  # type: ignore[union-attr]
                           .group(1).replace("'", '"'))
    assert transport["shared"] > 0 and transport["pickled"] == 0 and "no_space" not in transport
    assert "warned []" in done.stdout
    assert re.search(r"cache refused: .*1\.00 GiB does not fit.*0\.0\d GiB free", done.stdout)


# -- joins off the loop -------------------------------------------------------------------------


async def test_pass_ends_and_aclose_never_block_the_event_loop(
    local_paths: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.5
    caplog.set_level(logging.WARNING, logger="asyncio")
    try:
        for persistent in (False, True):
            loader = aioloader.Loader(aioloader.Files(local_paths), decode=slow_index,
                                      batch_size=4, persistent_workers=persistent)
            for _ in range(2):
                async for _ in loader:
                    break
                await asyncio.sleep(0.1)
            _ = [b async for b in loader]
            await loader.aclose()
    finally:
        loop.set_debug(False)
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert not slow, slow


def test_packages_decode_imports_are_preloaded_for_the_next_pass(local_paths: list[str]) -> None:
    from decoders import wave_was_loaded

    loader = aioloader.Loader(aioloader.Files(local_paths), decode=wave_was_loaded,
                              batch_size=10)  # a new pair of decode processes each pass
    with loader:
        first = [bool(x) for batch in loader for x in batch]
        second = [bool(x) for batch in loader for x in batch]
    assert not all(first)  # the zygote did not have it
    assert all(second)  # it learnt it from the first pass's processes


def test_the_packages_behind_a_decode_function_are_found_for_the_zygote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode function of the user's own module brings the installed packages that module
    (and the user's modules it uses) import: the zygote imports them before forking."""
    from aioloader._ipc.channel import dumps
    from aioloader._worker.preload import packages_behind

    (tmp_path / "user_helpers.py").write_text("import json\n\ndef describe(x):\n    return x\n")
    (tmp_path / "user_decoders.py").write_text(
        "import numpy\nfrom user_helpers import describe\n\n"
        "def decode(raw):\n    return describe(numpy.frombuffer(raw, numpy.uint8))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import user_decoders  # type: ignore[import-not-found]

        found = packages_behind([dumps(user_decoders.decode)])
    finally:
        sys.modules.pop("user_decoders", None)
        sys.modules.pop("user_helpers", None)
    assert {"numpy", "json"} <= set(found)
    assert "user_decoders" not in found and "user_helpers" not in found


def _renamed(function: Any) -> Any:
    def wrapper(*args: Any) -> Any:  # no functools.wraps: the method's name is now "wrapper"
        return function(*args)
    return wrapper


class _Scaler:
    def __init__(self, factor: int) -> None:
        self.factor = factor

    @_renamed
    def scale(self, value: int) -> int:
        return self.factor * value


def test_chunk_messages_send_a_renamed_bound_method_by_value_not_by_its_name() -> None:
    """The standard pickler saves a bound method as its object's attribute of the function's
    name, which a decorator may have changed; such a method goes by cloudpickle."""
    from aioloader._ipc.channel import dumps_data

    sent = pickle.loads(b"".join(dumps_data({"decode": _Scaler(3).scale})))
    assert sent["decode"](7) == 21


def test_chunk_messages_go_by_the_standard_pickler_whatever_their_bytes_hold() -> None:
    """Sample bytes that happen to contain `__main__` are no reason for cloudpickle (they are
    never searched), while a class of `__main__`, which the other process cannot find by
    name, still goes by value."""
    from aioloader._ipc.channel import dumps_data

    raws = [b"x" * 100 + b"__main__" + b"y" * 100, np.frombuffer(b"__main__", np.uint8)]
    assert b"".join(dumps_data(raws)) == pickle.dumps(raws, pickle.HIGHEST_PROTOCOL)
    large = [os.urandom(1 << 20), np.arange(1 << 18, dtype=np.float32)]  # sent from their memory
    parts = dumps_data(large)
    assert any(part.obj is large[0] for part in parts)
    assert any(part.nbytes == large[1].nbytes for part in parts)
    loaded = pickle.loads(b"".join(parts))
    assert loaded[0] == large[0] and np.array_equal(loaded[1], large[1])

    class Script:
        pass

    Script.__module__, Script.__qualname__ = "__main__", "Script"
    main = sys.modules["__main__"]
    main.Script = Script  # type: ignore[attr-defined]  # found by name here, as a script's
    try:
        sent = b"".join(dumps_data([Script()]))
    finally:
        del main.Script  # type: ignore[attr-defined]
    assert b"_make_skeleton_class" in sent and isinstance(pickle.loads(sent)[0], Script)


class _ShortFetchMany(aioloader.Dataset):
    """Its `fetch_many` drops the last item of each call."""

    batched_fetch = True

    def __len__(self) -> int:
        return 20

    async def fetch(self, index: int) -> int:
        return index

    async def fetch_many(self, indices: Sequence[int]) -> list[int]:
        return list(indices)[:-1]


def test_a_fetch_many_that_gives_the_wrong_count_is_read_sample_by_sample() -> None:
    loader = aioloader.Loader(_ShortFetchMany(), batch_size=5, num_workers=0)
    assert [int(i) for batch in loader for i in batch] == list(range(20))
