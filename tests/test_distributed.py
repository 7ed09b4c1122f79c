"""Two ranks under torchrun (gloo, CPU), and decoding on a Dask cluster's executor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import aioloader

from decoders import index_and_noise

ROOT = Path(__file__).resolve().parent.parent


def test_torchrun_two_ranks_see_disjoint_shares_and_the_model_learns(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distributed_digits.py"), "--out", str(tmp_path),
         "--epochs", "5"],
        check=True, timeout=240, capture_output=True,
    )
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for epoch in range(5):
        first, second = (set(r["seen"][epoch]) for r in ranks)
        assert not first & second
        assert first | second == set(range(1500))
    assert ranks[0]["seen"][0] != ranks[0]["seen"][1]  # a new order every epoch
    assert ranks[0]["accuracy"] > 0.7  # ten classes: chance is 0.1


def test_dask_executor_gives_the_same_batches_as_the_built_in_pool(urls: list[str]) -> None:
    distributed = pytest.importorskip("distributed")

    def run(**pool: object) -> list[dict[str, np.ndarray]]:
        with aioloader.Loader(aioloader.Files(urls), decode=index_and_noise, batch_size=16,
                              shuffle=True, **pool) as loader:  # type: ignore[arg-type]
            return list(loader)

    reference = run(num_workers=2)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        got = run(executor=client.get_executor())
    assert len(got) == len(reference)
    for a, b in zip(got, reference, strict=True):
        np.testing.assert_array_equal(a["index"], b["index"])
        np.testing.assert_array_equal(a["noise"], b["noise"])


def test_executor_and_worker_init_do_not_mix(urls: list[str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as executor, pytest.raises(ValueError, match="worker_init"):
        aioloader.Loader(aioloader.Files(urls), executor=executor, worker_init=print)


@pytest.mark.parametrize(("format", "service", "store"),
                         [("tar", "process", "http"), ("parquet", "node", "http"),
                          ("tfrecord", "none", "s3")])
def test_torchrun_on_uneven_shards_steps_together_resumes_on_three_ranks_and_survives_a_fork(
    tmp_path: Path, format: str, service: str, store: str
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    if format == "parquet":
        pytest.importorskip("pyarrow")
    if store == "s3":
        for needed in ("moto", "boto3", "obstore"):
            pytest.importorskip(needed)
    job = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distributed_tar_shards.py"),
         "--out", str(tmp_path), "--format", format, "--service", service, "--store", store],
        timeout=400, capture_output=True, text=True,
    )
    assert job.returncode == 0, f"the job failed:\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"

    def seen(world_size: int) -> list[dict[str, list[int]]]:
        return [json.loads((tmp_path / f"ranks-{world_size}-rank-{r}.json").read_text())["seen"]
                for r in range(world_size)]

    two, three = seen(2), seen(3)
    for epoch in ("0", "1"):  # whole epochs on two ranks: equal steps, every digit
        assert len(two[0][epoch]) == len(two[1][epoch]) == 750
        assert set(two[0][epoch]) | set(two[1][epoch]) == set(range(1500))
    before = [i for rank in two for i in rank["2"]]
    after = [i for rank in three for i in rank["2"]]
    assert len(two[0]["2"]) == len(two[1]["2"]) == 6 * 16
    assert len({len(rank["2"]) for rank in three}) == 1  # three ranks step together
    assert set(before) | set(after) == set(range(1500))  # the resumed epoch skips nothing
    assert len(before) + len(after) - 1500 < 3  # repeats only to pad
