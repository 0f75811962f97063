"""Decentralized SGD (allreduce/gossip.py) against a few-line one-process reference: N models
x_i, each step X <- W X - lr G with G the gradient of each x_i on its own data shard (Lian et
al.'s Algorithm 1), in float64. The run's model is the workers' mean, and its consensus
distance (the mean of ||x_i - mean x||^2) is the reference's."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from allreduce.topology import matrix
from experiments.settings.presets import build_config
from experiments.workloads.datasets import BatchFeeder
from experiments.workloads.tasks import get_task

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

PLAIN = ("dtype=float64", "threads=1", "optim.momentum=0")
STEPS, WORKERS = 20, 4
TOPOLOGIES = ("ring", "one-peer-exponential", "exponential", "complete")  # a 2x2 torus is a 4-cycle


def POOL_JOBS() -> dict[str, dict]:
    jobs = {t: dict(experiment="quickstart", engine="gossip", workers=WORKERS, steps=STEPS,
                    overrides=PLAIN + (f"gossip.topology={t}", "gossip.consensus_every=5")) for t in TOPOLOGIES}
    jobs["allreduce"] = dict(experiment="quickstart", engine="allreduce", workers=WORKERS, steps=STEPS, overrides=PLAIN)
    return jobs


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


def reference(topology: str, steps: int = STEPS, workers: int = WORKERS) -> tuple[torch.Tensor, list[float]]:
    """X <- W X - lr G from the run's initial model on the run's shards: (X, the consensus
    distance after every step)."""
    cfg = build_config("quickstart", PLAIN, engine="gossip", workers=workers, steps=steps)
    dataset = cfg.data.build(cfg.seed)
    task = get_task(dataset.task)
    torch.manual_seed(cfg.seed)
    model = cfg.model.build().double()
    x = parameters_to_vector(model.parameters()).detach().repeat(workers, 1)
    feeders = [BatchFeeder(dataset, i, workers, cfg.batch_size, cfg.seed, torch.float64) for i in range(workers)]
    distances = []
    for step in range(steps):
        grads = []
        for i, feeder in enumerate(feeders):
            vector_to_parameters(x[i], model.parameters())
            model.zero_grad()
            inputs, targets = feeder.batch(step)
            task.loss(model(*inputs), targets).backward()
            grads.append(parameters_to_vector(p.grad for p in model.parameters()))
        x = torch.tensor(matrix(topology, workers, step), dtype=torch.float64) @ x - cfg.optim.lr * torch.stack(grads)
        distances.append(((x - x.mean(0)) ** 2).sum(1).mean().item())
    return x, distances


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_d_psgd_is_the_one_process_reference(results, topology):
    summary, state = results[topology]
    x, distances = reference(topology)
    ours = torch.cat([state[k].reshape(-1) for k in state])
    assert (ours - x.mean(0)).abs().max().item() < 1e-10  # the run's model, the workers' mean
    assert abs(summary["consensus_distance"] - distances[-1]) < 1e-10
    assert distances[-1] > 1e-6 or topology == "complete"  # the workers do differ, except where W averages all


def test_at_four_workers_the_exponential_graph_is_the_complete_one_and_mixes_closer_than_the_ring(results):
    """i +- 1, +- 2 reach every other worker, each weighted 1/4 as the complete graph's; the
    denser graph keeps the models closer."""
    distance = {t: results[t][0]["consensus_distance"] for t in TOPOLOGIES}
    assert abs(distance["exponential"] - distance["complete"]) < 1e-12
    assert distance["complete"] < distance["ring"]


def test_a_ring_sends_two_models_a_step_and_one_peer_one(results):
    """The ring sends each neighbour the model, 2M a step: 4/3 of the ring all-reduce's 2(N-1)/N M
    at N=4; the one-peer exponential graph sends one M whatever N is."""
    m = sum(t.numel() * 8 for t in results["ring"][1].values())
    assert results["ring"][0]["sent_bytes_per_worker_per_step"] == 2 * m
    assert results["one-peer-exponential"][0]["sent_bytes_per_worker_per_step"] == m
    assert results["complete"][0]["sent_bytes_per_worker_per_step"] == (WORKERS - 1) * m
    ratio = results["ring"][0]["sent_bytes_per_worker_per_step"] / results["allreduce"][0]["sent_bytes_per_worker_per_step"]
    assert abs(ratio - 4 / 3) < 0.02 * 4 / 3
