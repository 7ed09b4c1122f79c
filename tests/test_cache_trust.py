"""A named SharedCache lives in /dev/shm under names anyone can predict, so another user can
make those files first. These tests play that user for real (a forked child that drops to an
unused uid) and check that the cache refuses the files with a clear error, runs nothing they
hold and writes nothing through them; and that an index its owner corrupted gives a clear error
or a miss, never a crash or a read outside the segment."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import pwd
import secrets
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from aioloader import SharedCache
from aioloader._cache import CorruptEntry
from aioloader._ipc import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm (Linux)")
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="playing a second user needs root (setuid in a forked child)"
)


def unused_uids(count: int) -> list[int]:
    """Uids no account has, from 64000 up: nobody's files can be at stake."""
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    return [uid for uid in range(64000, 65000) if uid not in taken][:count]


def as_user(uid: int, action: Callable[[], str]) -> str:
    """Run `action` in a forked child that is user and group `uid` and nothing else; what it
    returns, or the error it raised, as text."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(reader)
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                text = action()
            except BaseException as e:
                text = f"{type(e).__name__}: {e}"
            with os.fdopen(writer, "wb") as pipe:
                pipe.write(text.encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


class Shell:
    """Unpickling this runs a shell command: what a pickle-based cache would have run."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return os.system, (self.command,)


def pickle_record(marker: Path) -> bytes:
    """An entry in the cache's former format: (pickle length, buffer count), then the pickle."""
    payload = pickle.dumps(Shell(f"touch {marker}"))
    return struct.pack("<qq", len(payload), 0) + payload


def text_record(text: bytes, raw: bytes = b"") -> bytes:
    """An entry in the cache's format: description length, JSON, buffers from offset 64."""
    return struct.pack("<q", len(text)) + text.ljust(-(-(8 + len(text)) // 64) * 64 - 8) + raw


def json_record(description: object, raw: bytes = b"") -> bytes:
    return text_record(json.dumps(description).encode(), raw)


def nasty_json(marker: Path) -> bytes:
    """Object arrays over forged pointers, buffers and shapes beyond the segment, pickle bytes
    where arrays should be, a kind that does not exist."""
    value = {"l": [
        {"a": [0, "|O", [4]]},
        {"a": [1, "<f8", [1 << 40]]},
        {"a": [0, [["x", "|O"]], [1]]},
        {"g": [2, "|V8", []]},
        {"x": "os.system"},
    ]}
    buffers = [[0, 32], [-(1 << 40), 1 << 41], [32, 1 << 20]]
    forged = struct.pack("<4q", *[0x4141414141414141] * 4) + pickle.dumps(Shell(f"touch {marker}"))
    return json_record({"value": value, "buffers": buffers}, forged)


def plant(stem: str, record: bytes, members: bool = True) -> str:
    """As the attacker: make the segments first, mode 0666, the index pointing at `record`."""
    index = struct.pack("<qqqq", 10, len(record), 1, 0) + struct.pack("<qq", 0, len(record))
    index += bytes(16 * 9)
    files = {"-index": index, "-data": record.ljust(1 << 16, b"\0")}
    if members:
        files["-members"] = b""
    for ending, content in files.items():
        descriptor = os.open(shm.path(stem + ending), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        os.fchmod(descriptor, 0o666)
        os.write(descriptor, content)
        os.close(descriptor)
    return "planted"


def plant_links(stem: str, targets: list[Path]) -> str:
    """As the attacker: segment names that are symlinks to the victim's files."""
    for ending, target in zip(("-index", "-data", "-members"), targets, strict=True):
        os.symlink(target, shm.path(stem + ending))
    return "planted"


def use(name: str) -> str:
    """As the victim: attach, get, put and look up the named cache; each step's outcome."""
    cache = SharedCache(0.01, name=name)
    outcomes = []
    steps: list[Callable[[], object]] = [
        lambda: cache.attach(10), lambda: cache.get(0), lambda: cache.put(1, np.arange(3)),
        lambda: 0 in cache,
    ]
    for step in steps:
        try:
            outcomes.append(f"ok: {step()!r}")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}: {e}")
    cache.close()
    return "\n".join(outcomes)


@pytest.fixture
def name() -> Iterator[str]:
    """A cache name of this test's own; every segment under it is removed afterwards."""
    name = f"trust-{os.getpid()}-{secrets.token_hex(4)}"
    yield name
    for entry in os.listdir(shm.SHM_DIR):
        if f"-cache-{name}-" in entry:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm.path(entry))


@pytest.fixture
def drop() -> Iterator[Path]:
    """A directory anyone may write to, for the payload's marker and the victim's files."""
    folder = Path(tempfile.mkdtemp(prefix="aioloader-trust-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


ATTACKS = ["pickle payload", "crafted JSON", "index and data without members", "symlinks"]


def attack(kind: str, stem: str, drop: Path, victim: int) -> tuple[Callable[[], str], list[Path]]:
    """The attacker's action for `kind`, and the victim's files it aims at."""
    marker = drop / "marker"
    if kind == "pickle payload":
        return lambda: plant(stem, pickle_record(marker)), []
    if kind == "crafted JSON":
        return lambda: plant(stem, nasty_json(marker)), []
    if kind == "index and data without members":
        return lambda: plant(stem, nasty_json(marker), members=False), []
    targets = []
    for number in range(3):
        target = drop / f"precious-{number}"
        target.write_bytes(b"the victim's own data\n")
        target.chmod(0o600)
        os.chown(target, victim, victim)
        targets.append(target)
    return lambda: plant_links(stem, targets), targets


def assert_refused(outcome: str, attacker: int, drop: Path, targets: list[Path]) -> None:
    steps = outcome.splitlines()
    assert len(steps) == 4, outcome
    for step in steps:
        assert step.startswith("NotOwned: ") and "belongs to another user" in step, outcome
        assert f"uid {attacker}" in step, outcome
    assert not (drop / "marker").exists()  # nothing the attacker wrote ran
    for target in targets:  # nothing written through a link
        assert target.read_bytes() == b"the victim's own data\n"
        assert target.stat().st_mode & 0o777 == 0o600


@as_root
@pytest.mark.parametrize("kind", ATTACKS)
def test_root_refuses_segments_another_user_made_first(kind: str, name: str, drop: Path) -> None:
    (attacker,) = unused_uids(1)
    stem = f"aioloader-u0-cache-{name}"
    action, targets = attack(kind, stem, drop, 0)
    assert as_user(attacker, action) == "planted"
    assert_refused(use(name), attacker, drop, targets)
    assert os.path.lexists(shm.path(stem + "-index"))  # refused, not quietly removed either


@as_root
@pytest.mark.parametrize("kind", ATTACKS)
def test_a_user_refuses_segments_another_user_made_first(
    kind: str, name: str, drop: Path
) -> None:
    """Unlike root, a user cannot remove the other's files from sticky /dev/shm."""
    attacker, victim = unused_uids(2)
    action, targets = attack(kind, f"aioloader-u{victim}-cache-{name}", drop, victim)
    assert as_user(attacker, action) == "planted"
    assert_refused(as_user(victim, lambda: use(name)), attacker, drop, targets)


def test_the_planted_pickle_would_have_run(drop: Path) -> None:
    """The payload is live: a cache that unpickled it would have run the command."""
    record = pickle_record(drop / "marker")
    length, _ = struct.unpack_from("<qq", record)
    pickle.loads(record[16 : 16 + length])
    assert (drop / "marker").exists()


# -- an index corrupted by its owner -----------------------------------------------------------


def overwrite(token: str, offset: int, content: bytes) -> None:
    """Write into an unnamed cache's block, as its owner could."""
    descriptor = shm.open_block(token)
    try:
        os.pwrite(descriptor, content, offset)
    finally:
        os.close(descriptor)


RECORD_AT = 1 << 20
"""Where crafted records go in the data segment, past the real ones."""


def entry(cache: SharedCache, index: int, offset: int, length: int) -> None:
    overwrite(cache.names[0], 32 + 16 * index, struct.pack("<qq", offset, length))


def record(cache: SharedCache, content: bytes) -> None:
    overwrite(cache.names[1], RECORD_AT, content)
    entry(cache, 0, RECORD_AT, len(content))


def deep(levels: int) -> bytes:
    """A description nested deeper than Python recurses."""
    value = '{"l": [' * levels + "]}" * levels
    return text_record(f'{{"value": {value}, "buffers": []}}'.encode())


Corrupt = Callable[[SharedCache, Path], None]
CORRUPTIONS: dict[str, tuple[str, Corrupt]] = {
    "offset past the segment": ("miss", lambda c, _: entry(c, 0, 1 << 40, 64)),
    "negative offset": ("miss", lambda c, _: entry(c, 0, -4096, 64)),
    "length past the segment": ("miss", lambda c, _: entry(c, 0, 0, 1 << 60)),
    "garbage JSON": ("error", lambda c, _: record(c, struct.pack("<q", 12) + b"\xff{not json!")),
    "a pickle in the former format": ("error", lambda c, marker: record(c, pickle_record(marker))),
    "crafted JSON": ("error", lambda c, marker: record(c, nasty_json(marker))),
    "description longer than the entry": ("error", lambda c, _: record(
        c, struct.pack("<q", 1 << 40))),
    "negative description length": ("error", lambda c, _: record(
        c, struct.pack("<q", -8) + b"{}")),
    "entry shorter than its length field": ("error", lambda c, _: record(c, b"\x01")),
    "object array over raw bytes": ("error", lambda c, _: record(
        c, json_record({"value": {"a": [0, "|O", [4]]}, "buffers": [[0, 32]]}, bytes(32)))),
    "buffer before the entry": ("error", lambda c, _: record(
        c, json_record({"value": {"a": [0, "|u1", [-1]]}, "buffers": [[-4096, 64]]}))),
    "buffer past the entry": ("error", lambda c, _: record(
        c, json_record({"value": {"a": [0, "|u1", [-1]]}, "buffers": [[0, 1 << 30]]}, b"x"))),
    "shape larger than the buffer": ("error", lambda c, _: record(
        c, json_record({"value": {"a": [0, "<i8", [1000]]}, "buffers": [[0, 8]]}, bytes(8)))),
    "missing buffer": ("error", lambda c, _: record(
        c, json_record({"value": {"b": 7}, "buffers": []}))),
    "dtype that is not a string": ("error", lambda c, _: record(
        c, json_record({"value": {"a": [0, {"names": ["x"], "formats": ["O"]}, [1]]},
                        "buffers": [[0, 8]]}, bytes(8)))),
    "unknown kind": ("error", lambda c, _: record(
        c, json_record({"value": {"x": 1}, "buffers": []}))),
    "not a description": ("error", lambda c, _: record(c, json_record([1, 2, 3]))),
    "nesting deeper than Python recurses": ("error", lambda c, _: record(c, deep(100_000))),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_entry_is_a_miss_or_a_clear_error_never_a_crash(
    corruption: str, drop: Path
) -> None:
    expected, corrupt = CORRUPTIONS[corruption]
    with SharedCache(0.01) as cache:
        cache.attach(4)
        assert cache.put(0, np.arange(10)) and cache.put(1, "intact")
        corrupt(cache, drop / "marker")
        if expected == "miss":
            assert 0 not in cache and not cache.put(0, np.arange(3))  # the slot stays taken
        else:
            assert 0 in cache
            with pytest.raises(CorruptEntry, match="entry of sample 0 is corrupt"):
                cache.get(0)
        assert cache.get(1) == "intact"
    assert not (drop / "marker").exists()


@pytest.mark.parametrize("used", [-4096, 1 << 40])
def test_a_corrupt_header_stops_the_caching_instead_of_writing_anywhere(used: int) -> None:
    with SharedCache(0.01) as cache:
        cache.attach(4)
        overwrite(cache.names[0], 0, struct.pack("<qqqq", 1 << 40, used, 0, 0))
        assert not cache.put(2, np.arange(10)) and 2 not in cache
        assert 1000 not in cache and not cache.put(1000, 1)  # beyond the index segment
        with pytest.raises(KeyError):
            cache.get(1000)
        assert cache.report()["samples"] == 0


def test_a_joiner_of_another_size_writes_within_the_segment(name: str) -> None:
    with SharedCache(0.001, name=name) as small, SharedCache(0.01, name=name) as large:
        small.attach(4)
        large.attach(4)
        assert large.report()["size_limit_gib"] == small.report()["size_limit_gib"]
        assert large.put(1, np.arange(3)) and small.get(1).tolist() == [0, 1, 2]
        big = np.zeros(2 << 20, np.uint8)  # fits the size asked for, not the segment made
        assert not large.put(0, big) and large.report()["full"] == 1
