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
        "diloco": dict(experiment="quickstart", engine="allreduce", steps=STEPS,
                       overrides=F64 + LOCAL + ("allreduce.outer=nesterov", "allreduce.algorithm=ring")),
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


def test_each_reduced_step_records_when_backward_released_its_buckets(results, pool):
    """What psar predict plays (analysis/overlap.py): the buckets' start times within backward
    and their bytes, on every step that all-reduced its gradient, and on no other."""
    def records(name):
        lines = (pool.folder(__name__) / name / "metrics" / "rank0.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    for r in records("library-every-step"):
        assert sum(size for _, size in r["buckets"]) == 9610 * 8
        starts = [at for at, _ in r["buckets"]]
        assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] <= r["backward_s"] + 1e-6
    local = records("library-local")
    assert [("buckets" in r) for r in local] == [True] * 3 + [False] * (STEPS - 3)  # the warm-up's, then local steps


def diloco_reference(workers: int = 2, warmup: int = 3, period: int = 4, steps: int = STEPS):
    """DiLoCo in one process, from the run's initial model on the run's shards: each worker's
    own SGD with momentum on its own gradient (the averaged one during the warm-up); at the
    averaging steps the shared model takes a Nesterov step (lr 0.7, momentum 0.9) on the shared
    model less the workers' mean, and every worker starts again from it. Worker 0's parameters."""
    import torch
    from torch.nn.utils import parameters_to_vector

    from experiments.settings.presets import build_config
    from experiments.workloads.datasets import BatchFeeder
    from experiments.workloads.tasks import get_task

    cfg = build_config("quickstart", F64, engine="allreduce", workers=workers, steps=steps)
    dataset = cfg.data.build(cfg.seed)
    task = get_task(dataset.task)
    models = []
    for _ in range(workers):
        torch.manual_seed(cfg.seed)
        models.append(cfg.model.build().double())
    inner = [cfg.optim.build(list(m.parameters())) for m in models]
    feeders = [BatchFeeder(dataset, i, workers, cfg.batch_size, cfg.seed, torch.float64) for i in range(workers)]
    shared = outer = None
    for step in range(steps):
        for model, feeder in zip(models, feeders):
            model.zero_grad()
            inputs, targets = feeder.batch(step)
            task.loss(model(*inputs), targets).backward()
        if step < warmup:  # the gradients averaged, as period 1
            for params in zip(*(m.parameters() for m in models)):
                mean = sum(p.grad for p in params) / workers
                for p in params:
                    p.grad = mean.clone()
        elif shared is None:
            shared = [p.detach().clone() for p in models[0].parameters()]
            outer = torch.optim.SGD(shared, lr=0.7, momentum=0.9, nesterov=True)
        for optimizer in inner:
            optimizer.step()
        if step >= warmup and (step - warmup) % period == 0:
            with torch.no_grad():
                for s, params in zip(shared, zip(*(m.parameters() for m in models))):
                    s.grad = s - sum(p for p in params) / workers
                outer.step()
                for s, params in zip(shared, zip(*(m.parameters() for m in models))):
                    for p in params:
                        p.copy_(s)
    return parameters_to_vector(models[0].parameters()).detach()


def test_diloco_ends_as_the_one_process_reference(results):
    """allreduce.outer=nesterov: DiLoCo's outer Nesterov step on the averaged change of local
    SGD, float64, within 1e-10; and it is not plain local SGD."""
    import torch

    _, ours = results["diloco"]
    flat = torch.cat([t.reshape(-1) for t in ours.values()])
    assert (flat - diloco_reference()).abs().max().item() < 1e-10
    assert max_param_diff(results["library-local"][1], ours) > 1e-6
