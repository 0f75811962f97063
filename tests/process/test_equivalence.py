"""The heart of the testbed: every engine computes the same update.

After 20 steps in float64, local, ddp, allreduce/library and allreduce/ring, with bucket caps
from one bucket per parameter to one bucket for the whole model, end with the same
parameters (and rank 0's BatchNorm buffers) within 1e-10; in float32 within 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest

from conftest import max_param_diff, max_rel_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

EXPERIMENTS = ("quickstart", "cnn")
# One thread per process everywhere, so float32 kernels reduce in the same order.
F64 = ("dtype=float64", "threads=1")
F32 = ("threads=1",)
RING = ("allreduce.algorithm=ring",)
PER_PARAM = ("allreduce.bucket_cap_mb=0.000001", "allreduce.first_bucket_mb=0.000001")
WHOLE_MODEL = ("allreduce.bucket_cap_mb=1000", "allreduce.first_bucket_mb=1000")

VARIANTS = {
    "ddp": ("ddp", ()),
    "library": ("allreduce", ()),
    "library-per-param": ("allreduce", PER_PARAM),
    "ring": ("allreduce", RING),
    "ring-per-param": ("allreduce", RING + PER_PARAM),
    "ring-whole-model": ("allreduce", RING + WHOLE_MODEL),
    "halving-doubling": ("allreduce", ("allreduce.algorithm=halving-doubling",)),
    "tree": ("allreduce", ("allreduce.algorithm=tree",)),
}
F32_VARIANTS = ("ddp", "library", "ring")


def POOL_JOBS() -> dict[str, dict]:
    jobs = {}
    for exp in EXPERIMENTS:
        jobs[f"{exp}-local-f64"] = dict(experiment=exp, engine="local", overrides=F64)
        jobs[f"{exp}-local-f32"] = dict(experiment=exp, engine="local", overrides=F32)
        for variant, (engine, extra) in VARIANTS.items():
            jobs[f"{exp}-{variant}-f64"] = dict(experiment=exp, engine=engine, overrides=F64 + extra)
        for variant in F32_VARIANTS:
            engine, extra = VARIANTS[variant]
            jobs[f"{exp}-{variant}-f32"] = dict(experiment=exp, engine=engine, overrides=F32 + extra)
    jobs["q3-local-f64"] = dict(experiment="quickstart", engine="local", workers=3, overrides=F64)
    jobs["q3-ring-f64"] = dict(experiment="quickstart", engine="allreduce", workers=3,
                               overrides=F64 + RING + PER_PARAM)
    for name, algorithm in (("hd", "halving-doubling"), ("tree", "tree"), ("auto", "auto")):
        jobs[f"q3-{name}-f64"] = dict(experiment="quickstart", engine="allreduce", workers=3,
                                      overrides=F64 + PER_PARAM + (f"allreduce.algorithm={algorithm}",))
    # racks of 1 and 2 workers (worker 0 alone): the cross-rack ring, and a fold in the larger rack
    jobs["q3-hierarchical-f64"] = dict(experiment="quickstart", engine="allreduce", workers=3, overrides=F64 + (
        "allreduce.algorithm=hierarchical", "net.racks=2", "net.worker_racks=0,1,1"))
    for algorithm in ("library", "ring"):
        jobs[f"fp16-{algorithm}"] = dict(
            experiment="quickstart", engine="allreduce",
            overrides=F32 + (f"allreduce.algorithm={algorithm}", "allreduce.compression=fp16"))
    jobs["fp16-ddp"] = dict(experiment="quickstart", engine="ddp",
                            overrides=F32 + ("allreduce.compression=fp16",))
    # compress.method is the one setting; each family's own name for its casts stays.
    jobs["fp16-library-compress"] = dict(experiment="quickstart", engine="allreduce",
                                         overrides=F32 + ("compress.method=fp16",))
    for method in ("topk", "randomk"):  # every entry sent: the uncompressed run, up to the sum's order
        jobs[f"{method}-whole-allreduce"] = dict(experiment="quickstart", engine="allreduce",
                                                 overrides=F64 + (f"compress.method={method}", "compress.ratio=1.0"))
    jobs["topk-allreduce"] = dict(experiment="quickstart", engine="allreduce",
                                  overrides=F64 + ("compress.method=topk", "compress.ratio=0.05"))
    for engine in ("ddp", "allreduce"):
        jobs[f"powersgd-{engine}"] = dict(experiment="quickstart", engine=engine, overrides=F64 + (
            "compress.method=powersgd", f"compress.start_step={POWERSGD_START}"))
    for name, setting in (("own", "ps.compression=bf16"), ("compress", "compress.method=bf16")):
        jobs[f"bf16-ps-{name}"] = dict(experiment="quickstart", engine="ps-sync", overrides=F32 + (setting,))
    return jobs


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float64_engines_match_local(results, experiment, variant):
    ref_summary, ref = results[f"{experiment}-local-f64"]
    summary, state = results[f"{experiment}-{variant}-f64"]
    assert summary["steps"] == 20 and summary["workers"] == 2
    assert max_param_diff(ref, state) < 1e-10
    # Training moved the parameters, so the equality is not the trivial kind.
    assert ref_summary["final_loss"] < 2.2


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("variant", F32_VARIANTS)
def test_float32_engines_match_local(results, experiment, variant):
    _, ref = results[f"{experiment}-local-f32"]
    _, state = results[f"{experiment}-{variant}-f32"]
    assert max_rel_diff(ref, state) < 1e-5


def test_ring_with_three_workers_matches_local(results):
    assert max_param_diff(results["q3-local-f64"][1], results["q3-ring-f64"][1]) < 1e-10


@pytest.mark.parametrize("name", ["hd", "tree", "auto", "hierarchical"])
def test_halving_doubling_folded_tree_auto_and_hierarchical_with_three_workers_match_local(results, name):
    assert max_param_diff(results["q3-local-f64"][1], results[f"q3-{name}-f64"][1]) < 1e-10


def test_hierarchical_ran_on_the_racks_given(results):
    assert results["q3-hierarchical-f64"][0]["racks"] == [0, 1, 1]


@pytest.mark.parametrize("algorithm", ["library", "ring", "ddp"])
def test_compressed_wire_is_close_but_not_exact(results, algorithm):
    diff = max_rel_diff(results["quickstart-local-f32"][1], results[f"fp16-{algorithm}"][1])
    assert 0 < diff < 1e-2


POWERSGD_START = 3


def test_ddp_runs_powersgd_through_torchs_hook(results, pool):
    """Whole gradients for start_step steps, then rank-1 P and Q for quickstart's two weight
    matrices (its biases go whole), as torch's powerSGD_hook decides; the parameters leave the
    uncompressed run's."""
    summary, state = results["powersgd-ddp"]
    _, dense = results["quickstart-ddp-f64"]
    assert 1e-6 < max_param_diff(dense, state) and summary["final_loss"] < 2.2
    sent = [json.loads(line)["bytes_sent"] for line in
            (pool.folder(__name__) / "powersgd-ddp" / "metrics" / "rank0.jsonl").read_text().splitlines()]
    shapes = [t.shape for t in state.values()]
    whole = sum(s.numel() for s in shapes) * 8  # float64, 2 workers: the ring's 2(N-1)/N is 1
    low_rank = sum((s[0] + s[1]) if len(s) == 2 else s.numel() for s in shapes) * 8
    assert sent[:POWERSGD_START] == [whole] * POWERSGD_START
    assert set(sent[POWERSGD_START:]) == {low_rank} and low_rank < whole / 5


@pytest.mark.parametrize("method", ["topk", "randomk"])
def test_top_k_and_random_k_of_every_entry_train_as_uncompressed(results, method):
    assert max_param_diff(results["quickstart-library-f64"][1], results[f"{method}-whole-allreduce"][1]) < 1e-12


def test_top_k_is_all_gathered_with_its_indices(results, pool):
    """quickstart's one bucket of 9610 float64 gradients: 481 values and their int32 indices,
    sent to the other worker; error feedback keeps what is left for later steps."""
    summary, state = results["topk-allreduce"]
    assert 1e-3 < max_param_diff(results["quickstart-library-f64"][1], state) and summary["final_loss"] < 2.2
    sent = {json.loads(line)["bytes_sent"] for line in
            (pool.folder(__name__) / "topk-allreduce" / "metrics" / "rank0.jsonl").read_text().splitlines()}
    assert sent == {481 * (8 + 4)}
    # summary.json: each direction apart (an all-gather receives as many bytes as it sends).
    assert summary["sent_bytes_per_worker_per_step"] == summary["recv_bytes_per_worker_per_step"] == 481 * 12
    assert summary["bytes_per_worker_per_step"] == 2 * 481 * 12


def test_allreduce_powersgd_ends_as_torchs_hook_under_ddp(results, pool):
    """Same rank, start step, warm start and seed; quickstart's one bucket is laid out as DDP's,
    and the engine draws Q's first values as torch does, so the two end equal."""
    (_, ddp), (_, ours) = results["powersgd-ddp"], results["powersgd-allreduce"]
    assert max_param_diff(ddp, ours) < 1e-10 and max_param_diff(results["quickstart-library-f64"][1], ours) > 1e-6

    def sent(name):
        lines = (pool.folder(__name__) / name / "metrics" / "rank0.jsonl").read_text().splitlines()
        return [json.loads(line)["bytes_sent"] for line in lines]

    assert sent("powersgd-allreduce") == sent("powersgd-ddp")


def test_compress_method_is_the_engines_own_compression(results, pool):
    assert max_param_diff(results["fp16-library"][1], results["fp16-library-compress"][1]) == 0
    (own_summary, own), (summary, state) = results["bf16-ps-own"], results["bf16-ps-compress"]
    assert max_param_diff(own, state) == 0 and 0 < max_rel_diff(results["quickstart-local-f32"][1], state) < 1e-1
    # The gradients' bytes are the same; the few control messages may differ by a byte or so.
    assert summary["bytes_per_worker_per_step"] == pytest.approx(own_summary["bytes_per_worker_per_step"], rel=1e-4)
    config = json.loads((pool.folder(__name__) / "bf16-ps-compress" / "config.json").read_text())
    assert config["ps"]["compression"] == "bf16" == config["compress"]["method"]
