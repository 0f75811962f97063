"""ZeRO (allreduce/zero.py): every stage computes the update every engine computes, sends
the bytes of the paper's formula, and holds 1/N of what it shards.

After 20 steps in float64, zero stages 1 and 2 end with local's parameters (and rank 0's
BatchNorm buffers) within 1e-10 on quickstart and cnn with SGD and momentum, on quickstart
with AdamW, and with three workers (a bucket that does not divide by 3 is padded)."""

from __future__ import annotations

import pytest

from conftest import max_param_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

F64 = ("dtype=float64", "threads=1")
ADAMW = ("optim.name=adamw", "optim.lr=0.01", "optim.weight_decay=0.01")
STAGES = (1, 2)


def POOL_JOBS() -> dict[str, dict]:
    jobs = {}
    for exp, extra in (("quickstart", ()), ("cnn", ()), ("adamw", ADAMW)):
        experiment = "quickstart" if exp == "adamw" else exp
        jobs[f"{exp}-local"] = dict(experiment=experiment, engine="local", overrides=F64 + extra)
        for stage in STAGES:
            jobs[f"{exp}-zero{stage}"] = dict(experiment=experiment, engine="zero",
                                              overrides=F64 + extra + (f"zero.stage={stage}",))
    jobs["quickstart-allreduce"] = dict(experiment="quickstart", engine="allreduce", overrides=F64)
    jobs["q3-local"] = dict(experiment="quickstart", engine="local", workers=3, overrides=F64)
    jobs["q3-zero2"] = dict(experiment="quickstart", engine="zero", workers=3,
                            overrides=F64 + ("zero.stage=2", "zero.bucket_mb=0.01", "zero.first_bucket_mb=0.01"))
    return jobs


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


@pytest.mark.parametrize("experiment", ["quickstart", "cnn", "adamw"])
@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_ends_with_locals_parameters(results, experiment, stage):
    ref_summary, ref = results[f"{experiment}-local"]
    summary, state = results[f"{experiment}-zero{stage}"]
    assert summary["steps"] == 20 and ref_summary["final_loss"] < 2.2
    assert max_param_diff(ref, state) < 1e-10


def test_three_workers_with_padded_buckets_end_with_locals_parameters(results):
    assert max_param_diff(results["q3-local"][1], results["q3-zero2"][1]) < 1e-10


def test_stage_one_and_two_send_what_an_all_reduce_sends(results):
    """The paper's 2(N-1)/N of the model's bytes a step: a reduce-scatter of the gradient and
    an all-gather of the values (quickstart's 9,610 float64 parameters divide by 2)."""
    sent = results["quickstart-allreduce"][0]["bytes_per_worker_per_step"]
    assert sent == 2 * 9610 * 8  # 2(N-1)/N of 76,880 bytes, each way
    for stage in STAGES:
        assert results[f"quickstart-zero{stage}"][0]["bytes_per_worker_per_step"] == sent


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_holds_the_papers_bytes(results, stage):
    """Psi = 9,610 float64 parameters, N = 2: whole parameters; whole gradients under stage 1,
    half under stage 2; AdamW's two moments of half the parameters, and its float32 step (the
    model's 76,880 bytes are one bucket: the first holds up to 1 MiB)."""
    psi, n = 9610 * 8, 2
    memory = results[f"adamw-zero{stage}"][0]["memory_bytes_per_worker"]
    assert memory["params"] == psi
    assert memory["grads"] == (psi if stage == 1 else psi // n)
    assert memory["optimizer"] == 2 * psi // n + 4
    assert memory["comm_buffers"] == (0 if stage == 1 else psi)  # stage 2: the bucket's gradient in flight
