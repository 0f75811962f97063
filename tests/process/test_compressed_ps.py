"""compress.method on the parameter server: the same arithmetic as the all-reduce engine.

In float64, for top-k, random-k, sign and QSGD with error feedback, ps-sync (pushes
compressed with each worker's error feedback, the shard decompressing and averaging, pulls
whole) ends with the parameters of the all-reduce engine with one bucket per parameter (the
PS's keys are quickstart's whole parameters), which all-gathers or all-reduces the same
messages: the engines differ, the arithmetic does not. With compressed pulls (the change
since the last pull, with the shard's error feedback) top-k at 1% moves at most 5% of the
dense bytes each way.
"""

from __future__ import annotations

import json

import pytest

from conftest import max_param_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

F64 = ("dtype=float64", "threads=1")
PER_PARAM = ("allreduce.bucket_cap_mb=0.000001", "allreduce.first_bucket_mb=0.000001")
METHODS = {
    "topk": ("compress.method=topk", "compress.ratio=0.05"),
    "randomk": ("compress.method=randomk", "compress.ratio=0.05"),
    "sign": ("compress.method=sign",),
    "qsgd": ("compress.method=qsgd", "compress.levels=4"),
}


def POOL_JOBS() -> dict[str, dict]:
    jobs = {"dense-ps": dict(experiment="quickstart", engine="ps-sync", overrides=("threads=1",)),
            "topk1-ps": dict(experiment="quickstart", engine="ps-sync",
                             overrides=("threads=1", "compress.method=topk", "compress.ratio=0.01")),
            "dense-allreduce": dict(experiment="quickstart", engine="allreduce", overrides=F64 + PER_PARAM)}
    for method, settings in METHODS.items():
        jobs[f"{method}-allreduce"] = dict(experiment="quickstart", engine="allreduce",
                                           overrides=F64 + PER_PARAM + settings)
        jobs[f"{method}-ps"] = dict(experiment="quickstart", engine="ps-sync",
                                    overrides=F64 + settings + ("compress.pull=false",))
    return jobs


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


@pytest.mark.parametrize("method", list(METHODS))
def test_ps_sync_ends_as_allreduce_under_every_method(results, method):
    (ar_summary, ar), (ps_summary, ps) = results[f"{method}-allreduce"], results[f"{method}-ps"]
    assert max_param_diff(ar, ps) < 1e-10
    assert max_param_diff(results["dense-allreduce"][1], ps) > 1e-4  # compressed, not whole
    assert ps_summary["final_loss"] == pytest.approx(ar_summary["final_loss"], rel=1e-9)


def test_top_k_at_one_percent_moves_at_most_five_percent_each_way(results, pool):
    (dense, _), (summary, _) = results["dense-ps"], results["topk1-ps"]
    for way in ("sent", "recv"):
        ratio = summary[f"{way}_bytes_per_worker_per_step"] / dense[f"{way}_bytes_per_worker_per_step"]
        assert 0.01 < ratio <= 0.05, (way, ratio)
    records = [json.loads(line) for line in
               (pool.folder(__name__) / "topk1-ps" / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert all(r["compress_s"] > 0 for r in records)
