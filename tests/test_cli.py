"""The command line, run as a user runs it: serve, demo, errors, help and --version."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import aioloader
from aioloader._tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*arguments: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aioloader", *arguments], capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(done: subprocess.CompletedProcess[str], pattern: str) -> None:
    """Exit status 2, no traceback, and the last line of stderr `PROG: error: ...`."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(r"aioloader( [a-z-]+)?: error: ", last), done.stderr
    assert re.search(pattern, last), last


def test_demo_prints_one_rate_per_loader_and_the_ratios(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    done = run_cli("demo", "--objects", "128", "--baseline-objects", "8", "--images", "24",
                   "--baseline-images", "6", "--cache-dir", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    rates = [line for line in done.stdout.splitlines() if re.search(r"\d (objects|images)/s", line)]
    assert len(rates) == 4, done.stdout  # aioloader and the baseline, for each part
    assert done.stdout.count("aioloader / one read per worker:") == 2


def test_demo_refuses_zero_images_in_one_line() -> None:
    assert_one_line_error(run_cli("demo", "--images", "0"), r"--images: must be >= 1")


def test_demo_refuses_bad_values_from_python_too() -> None:
    from aioloader._tools.demo import run_demo

    with pytest.raises(ValueError, match="images must be >= 1"):
        run_demo(images=0)


def test_version_is_the_package_version() -> None:
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"aioloader {aioloader.__version__}"


def test_every_option_has_help_and_says_its_default() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.option_strings and action.dest != "help":
                shown = formatter._get_help_string(action) or ""
                assert action.help and "(default" in shown, (name, action.option_strings)


def test_a_missing_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    done = run_cli("bench", f"@{tmp_path / 'no-such-list.txt'}")
    assert_one_line_error(done, r"no-such-list\.txt: No such file or directory")


def test_counts_must_be_positive(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("make-images", str(tmp_path), "--count", "-5"),
                          r"--count: must be >= 1, got -5")
    assert_one_line_error(run_cli("make-images", str(tmp_path), "--count", "x"),
                          r"expected a whole number")
    assert not any(tmp_path.iterdir())


def test_serve_refuses_a_missing_folder(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("serve", str(tmp_path / "nothing"), "--port", "0"),
                          r"nothing: no such file or folder")


def test_serve_stops_cleanly_and_promptly_on_ctrl_c(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")
    server = subprocess.Popen(
        [sys.executable, "-m", "aioloader", "serve", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().startswith("serving http://127.0.0.1:")
        interrupted = time.perf_counter()
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=10)
    finally:
        server.kill()
        server.wait(timeout=10)
    assert time.perf_counter() - interrupted < 5
    assert stderr == ""  # no "coroutine ignored GeneratorExit", no traceback
    assert server.returncode == 130


def test_example_with_decode_in_main_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path,
    )
    assert "async for" in out.stdout and "plain for" in out.stdout
