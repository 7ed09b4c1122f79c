"""The public surface and argument checks."""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

import aioloader
from aioloader._datasets.keys import KeyTable

from decoders import index_of

CONTRACT = {
    "Dataset", "Files", "Loader", "LoaderError", "default_collate", "get_worker_info",
}


def _closure_over_a_lock() -> object:
    lock = threading.Lock()

    def decode(raw: bytes) -> bytes:
        with lock:
            return raw

    return decode


DOCUMENTED_SUBMODULES = ["recordio", "storage", "testing", "torch", "vision"]


def test_public_surface_is_what_all_says() -> None:
    assert set(aioloader.__all__) >= CONTRACT
    for name in aioloader.__all__:
        assert hasattr(aioloader, name), name
    assert sorted(aioloader.__all__) == aioloader.__all__
    defined = {name for name in vars(aioloader) if not name.startswith("_")}
    assert defined <= set(aioloader.__all__) | set(DOCUMENTED_SUBMODULES)


def test_every_error_a_user_can_meet_is_importable_from_aioloader() -> None:
    import pkgutil

    for info in pkgutil.walk_packages(aioloader.__path__, "aioloader."):
        if info.name.endswith(("torch", "vision", "zygote_main", "__main__")):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, Exception)
                    and value.__module__ == info.name and not name.startswith("_")
                    and name != "SampleFetchError"  # caught as FetchError or SampleError
                    and (issubclass(value, aioloader.LoaderError)
                         or name in ("NotOwned", "CorruptEntry"))):
                assert getattr(aioloader, name, None) is value, f"{info.name}.{name}"


@pytest.mark.parametrize("name", DOCUMENTED_SUBMODULES)
def test_documented_submodules_define_nothing_public_outside_all(name: str) -> None:
    if name == "torch":
        pytest.importorskip("torch")
    module = importlib.import_module(f"aioloader.{name}")
    exported = set(module.__all__)
    assert all(hasattr(module, n) for n in exported)
    defined_here = {
        n for n, value in vars(module).items()
        if not n.startswith("_") and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", None) == module.__name__
    }
    assert defined_here <= exported, sorted(defined_here - exported)


def test_import_does_not_import_torch() -> None:
    code = "import sys, aioloader; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_loader_of_local_files_does_not_import_the_network_clients(tmp_path: Path) -> None:
    """aiohttp alone takes 0.15 s to import: a loader that never reads over HTTP or S3 leaves
    it (and obstore) out: in the trainer's process, and by the same code in a loader service."""
    (tmp_path / "a.bin").write_bytes(b"abcd")
    code = (
        "import sys, aioloader\n"
        f"loader = aioloader.Loader(aioloader.Files([{str(tmp_path / 'a.bin')!r}]), "
        "batch_size=1, num_workers=0)\n"
        "assert [bytes(b[0]) for b in loader] == [b'abcd']\n"
        "print(sorted(m for m in ('aiohttp', 'obstore') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"concurrency": -1}, "concurrency must be an integer >= 1"),
        ({"num_workers": -2}, "num_workers must be an integer >= 0"),
        ({"prefetch": 0}, "prefetch must be an integer >= 1"),
        ({"on_error": "ignore"}, 'on_error must be "raise" or "skip"'),
        ({"rank": 2, "world_size": 2}, "rank must be in 0..1"),
        ({"retries": -1}, "retries must be 0 or more"),
        ({"decode": _closure_over_a_lock()}, "cannot be sent to the decode processes"),
    ],
)
def test_bad_arguments_fail_at_construction(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        aioloader.Loader(aioloader.Files(["a.bin"]), **arguments)  # type: ignore[arg-type]


def test_lambda_is_fine_with_or_without_workers() -> None:
    aioloader.Loader(aioloader.Files(["a.bin"]), decode=lambda raw: raw, num_workers=0)
    aioloader.Loader(aioloader.Files(["a.bin"]), decode=lambda raw: raw, num_workers=2)


def test_labels_must_match_files() -> None:
    with pytest.raises(ValueError, match="2 labels for 1 files"):
        aioloader.Files(["a.bin"], labels=[1, 2])


def test_keys_cost_their_bytes_not_python_objects() -> None:
    keys = [f"s3-like/prefix/{i:08d}.jpg" for i in range(1_000_000)]
    table = KeyTable(keys)
    assert len(table) == 1_000_000 and table[123_456] == keys[123_456] and table[-1] == keys[-1]
    assert table.nbytes == sum(len(k) for k in keys) + 8 * len(keys)


def test_the_rng_goes_by_name_or_annotation_not_by_position() -> None:
    from aioloader._worker.decode import takes_rng

    def with_default(raw: bytes, rng: object = None) -> bytes:
        return raw

    def annotated(raw: bytes, generator: np.random.Generator) -> bytes:
        return raw

    def a_size(raw: bytes, size: int = 224) -> bytes:
        return raw

    assert takes_rng(with_default) and takes_rng(annotated) and takes_rng(lambda raw, rng: raw)
    assert not takes_rng(a_size) and not takes_rng(index_of) and not takes_rng(lambda a, b: a)
