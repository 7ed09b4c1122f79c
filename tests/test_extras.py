"""Each optional dependency, when missing, is named with the extra that installs it.

Every test runs a fresh interpreter in which the module cannot be imported, as if it were not
installed (`sys.modules[name] = None` makes `import name` raise ImportError).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run_without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nsys.modules[{module!r}] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                          text=True, timeout=60)


def cli_without(module: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return run_without(module, f"from aioloader._tools.cli import main\nmain({list(arguments)!r})")


def assert_names_extra(done: subprocess.CompletedProcess[str], extra: str) -> None:
    assert done.returncode != 0
    assert f"pip install 'aioloader[{extra}]'" in done.stderr.strip().splitlines()[-1], done.stderr


def assert_one_cli_line(done: subprocess.CompletedProcess[str], extra: str) -> None:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("aioloader: error: ")
    assert_names_extra(done, extra)


def test_missing_pillow_names_the_image_extra(tmp_path: Path) -> None:
    assert_names_extra(run_without("PIL", "from aioloader import vision\n"
                                          "vision.Decode()(b'not read')"), "image")
    assert_one_cli_line(cli_without("PIL", "make-images", str(tmp_path / "x"), "--count", "2"),
                        "image")


def test_missing_pillow_in_pack_names_the_image_extra(tmp_path: Path) -> None:
    (tmp_path / "src" / "cat").mkdir(parents=True)
    (tmp_path / "src" / "cat" / "0.jpg").write_bytes(b"bytes")
    done = cli_without("PIL", "pack", str(tmp_path / "src"), str(tmp_path / "o.rec"),
                       "--resize", "8", "--processes", "1")
    assert_one_cli_line(done, "image")


def test_demo_without_pillow_shows_the_headline_and_names_the_image_extra(
    tmp_path: Path,
) -> None:
    done = cli_without("PIL", "demo", "--objects", "64", "--baseline-objects", "4",
                       "--cache-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "objects/s" in done.stdout and "images/s" not in done.stdout
    assert "pip install 'aioloader[image]'" in done.stdout


@pytest.mark.parametrize(("prefix", "extra"), [("s3://bucket/p/", "s3"), ("gs://bucket/p/", "gcs"),
                                              ("az://container/p/", "azure")])
def test_missing_obstore_names_the_extra_of_the_store(prefix: str, extra: str) -> None:
    assert_names_extra(run_without("obstore", "import aioloader\n"
                                              f"aioloader.Files.from_prefix({prefix!r})"),
                       extra)
    assert_one_cli_line(cli_without("obstore", "inspect", prefix + "train.rec"), extra)


def test_missing_ray_names_the_ray_extra(tmp_path: Path) -> None:
    (tmp_path / "0.bin").write_bytes(b"x")
    code = (f"import aioloader\naioloader.Loader(aioloader.Files([{str(tmp_path / '0.bin')!r}]),"
            " executor='ray', decode=len)")
    assert_names_extra(run_without("ray", code), "ray")


def test_missing_torch_names_the_torch_extra() -> None:
    assert_names_extra(run_without("torch", "import aioloader.torch"), "torch")


def test_missing_pyarrow_names_the_parquet_extra(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"x": [1, 2, 3]}), tmp_path / "t.parquet")
    code = f"import aioloader\naioloader.Parquet({str(tmp_path / 't.parquet')!r})"
    assert_names_extra(run_without("pyarrow", code), "parquet")


def test_missing_crc32c_names_the_tfrecord_extra(tmp_path: Path) -> None:
    from aioloader import tfrecord

    with tfrecord.Writer(tmp_path / "t.tfrecord") as writer:
        writer.write(tfrecord.example({"x": b"1"}))
    path = str(tmp_path / "t.tfrecord")
    code = f"import aioloader\naioloader.TFRecord({path!r}, index_dir={str(tmp_path)!r})"
    assert_names_extra(run_without("crc32c", code), "tfrecord")
    assert_one_cli_line(cli_without("crc32c", "inspect", path), "tfrecord")


def test_missing_matplotlib_names_the_plot_extra_before_bench_runs(tmp_path: Path) -> None:
    # the data does not exist: an error about it would mean the run started first
    done = cli_without("matplotlib", "bench", str(tmp_path / "missing.rec"),
                       "--timeline", str(tmp_path / "t.png"))
    assert_one_cli_line(done, "plot")
    assert "missing.rec" not in done.stderr
    code = "from aioloader._tools.timeline import draw\ndraw([], 't.png')"
    assert_names_extra(run_without("matplotlib", code), "plot")


def test_the_extras_named_exist_and_all_holds_every_one() -> None:
    tomllib = pytest.importorskip("tomllib")
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    optional = ["azure", "dask", "gcs", "image", "parquet", "plot", "ray", "s3", "tfrecord",
                "torch"]
    assert set(optional) <= extras.keys()
    assert extras["all"] == [f"aioloader[{','.join(optional)}]"]
