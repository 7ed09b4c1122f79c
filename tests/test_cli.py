"""The command line: serve and demo, run as a user would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_and_reports_the_ratio(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    out = subprocess.run(
        [sys.executable, "-m", "aioloader", "demo", "--images", "96", "--baseline-images", "24",
         "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert "images/s" in out.stdout and "ratio:" in out.stdout


def test_example_with_decode_in_main_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path,
    )
    assert "async for" in out.stdout and "plain for" in out.stdout
