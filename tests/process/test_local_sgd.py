"""Local SGD on the ring (allreduce.period, allreduce.period_warmup): the allreduce engine ends
as torch's post-local SGD under the ddp engine (post_localSGD_hook for the warm-up, then
PostLocalSGDOptimizer with PeriodicModelAverager), float64, within 1e-10; and its bytes are
the gradients' during the warm-up, the parameters' at each averaging, nothing between."""

from __future__ import annotations

import json

import pytest

from conftest import max_param_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

F64 = ("dtype=float64", "threads=1")
LOCAL = ("allreduce.period=4", "allreduce.period_warmup=3")
STEPS = 30


def POOL_JOBS() -> dict[str, dict]:
    return {
        "ddp-local": dict(experiment="quickstart", engine="ddp", steps=STEPS, overrides=F64 + LOCAL),
        "library-local": dict(experiment="quickstart", engine="allreduce", steps=STEPS, overrides=F64 + LOCAL),
        "ring-local": dict(experiment="quickstart", engine="allreduce", steps=STEPS,
                           overrides=F64 + LOCAL + ("allreduce.algorithm=ring",)),
        "library-every-step": dict(experiment="quickstart", engine="allreduce", steps=STEPS, overrides=F64),
    }


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


@pytest.mark.parametrize("variant", ["library-local", "ring-local"])
def test_local_sgd_ends_as_torchs_post_local_sgd(results, variant):
    _, torchs = results["ddp-local"]
    _, ours = results[variant]
    assert max_param_diff(torchs, ours) < 1e-10
    assert max_param_diff(results["library-every-step"][1], ours) > 1e-6  # local steps changed the run


def test_local_sgd_sends_gradients_then_parameters_every_period(results, pool):
    def sent(name):
        lines = (pool.folder(__name__) / name / "metrics" / "rank0.jsonl").read_text().splitlines()
        return [json.loads(line)["bytes_sent"] for line in lines]

    ours, torchs = sent("library-local"), sent("ddp-local")
    dense = sent("library-every-step")[0]  # quickstart's 9610 float64 values, 2 workers: 76880
    assert dense == 9610 * 8
    expected = [dense] * 3 + [dense if (s - 3) % 4 == 0 else 0 for s in range(3, STEPS)]
    assert ours == expected == torchs
