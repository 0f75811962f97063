"""Decentralized SGD (allreduce/gossip.py) against a few-line one-process reference: N models
x_i, each step X <- W X - lr G with G the gradient of each x_i on its own data shard (Lian et
al.'s Algorithm 1), in float64. The run's model is the workers' mean, and its consensus
distance (the mean of ||x_i - mean x||^2) is the reference's."""

from __future__ import annotations

import json

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
    jobs["async"] = dict(experiment="quickstart", engine="gossip", workers=WORKERS, steps=STEPS,
                         overrides=PLAIN + ("gossip.mode=async",))
    jobs["allreduce"] = dict(experiment="quickstart", engine="allreduce", workers=WORKERS, steps=STEPS, overrides=PLAIN)
    return jobs


@pytest.fixture(scope="module")
def results(pool):
    return pool.results(__name__)


def setup(workers: int = WORKERS):
    """The run's task, initial parameters, a model to compute gradients on, and each worker's
    batches."""
    cfg = build_config("quickstart", PLAIN, engine="gossip", workers=workers, steps=STEPS)
    dataset = cfg.data.build(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = cfg.model.build().double()
    feeders = [BatchFeeder(dataset, i, workers, cfg.batch_size, cfg.seed, torch.float64) for i in range(workers)]
    return cfg, get_task(dataset.task), model, feeders


def gradient(task, model, feeder, x: torch.Tensor, step: int) -> torch.Tensor:
    vector_to_parameters(x, model.parameters())
    model.zero_grad()
    inputs, targets = feeder.batch(step)
    task.loss(model(*inputs), targets).backward()
    return parameters_to_vector(p.grad for p in model.parameters())


def reference(topology: str, steps: int = STEPS, workers: int = WORKERS) -> tuple[torch.Tensor, list[float]]:
    """X <- W X - lr G from the run's initial model on the run's shards: (X, the consensus
    distance after every step)."""
    cfg, task, model, feeders = setup(workers)
    x = parameters_to_vector(model.parameters()).detach().repeat(workers, 1)
    distances = []
    for step in range(steps):
        grads = [gradient(task, model, feeder, x[i], step) for i, feeder in enumerate(feeders)]
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


def records(run_dir, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


def replay(run_dir, final: dict, workers: int = WORKERS) -> torch.Tensor:
    """AD-PSGD in one process, in the order the run's records say its changes to each model
    came: an active worker (even rank) reads its model, averages it with its partner, adds
    -lr g; a passive one adds -lr g computed at the model as it read it, and takes the
    averages in the order it served them. The workers' models, a row each."""
    cfg, task, model, feeders = setup(workers)
    x = parameters_to_vector(model.parameters()).detach().repeat(workers, 1)
    logs = {r: records(run_dir, r) for r in range(workers)}
    ops = {}  # passive rank: its changes in order, ("update", step) or ("average", active, step)
    for r in range(1, workers, 2):
        changes = {rec["gossip_applied"]: ("update", rec["step"]) for rec in logs[r]}
        changes.update({v: ("average", a, k) for rec in logs[r] for v, _, a, k in rec.get("gossip_ops", [])})
        changes.update({v: ("average", a, k) for v, a, k in final.get(str(r), [])})  # after its last step
        assert sorted(changes) == list(range(1, len(changes) + 1))
        ops[r] = [changes[v] for v in sorted(changes)]
    done = {r: 0 for r in ops}
    read = {r: {rec["gossip_read"]: rec["step"] for rec in logs[r]} for r in ops}
    snap: dict[tuple, torch.Tensor] = {}
    phase = {a: [0, "read"] for a in range(0, workers, 2)}
    while any(done[r] < len(ops[r]) for r in ops) or any(p[0] < STEPS for p in phase.values()):
        moved = False
        for a, (k, what) in phase.items():
            if k < STEPS and what == "read":
                snap[a, k] = x[a].clone()
                phase[a] = [k, "average"]
                moved = True
            elif what == "update":
                x[a] += -cfg.optim.lr * gradient(task, model, feeders[a], snap[a, k], k)
                phase[a] = [k + 1, "read"]
                moved = True
        for r in ops:
            if done[r] in read[r]:
                snap[r, read[r][done[r]]] = x[r].clone()
            if done[r] == len(ops[r]):
                continue
            change = ops[r][done[r]]
            if change[0] == "update":
                x[r] += -cfg.optim.lr * gradient(task, model, feeders[r], snap[r, change[1]], change[1])
            elif phase[change[1]] == [change[2], "average"]:
                x[r] = (x[r] + x[change[1]]) / 2
                x[change[1]] = x[r].clone()
                phase[change[1]] = [change[2], "update"]
            else:
                continue
            done[r] += 1
            moved = True
        assert moved, "the records' order cannot be replayed"
    return x


def test_ad_psgd_is_its_records_replayed_in_one_process(results, pool):
    """Every change to every model, in the order the run made it, gives the run's model (the
    workers' mean) and its consensus distance within 1e-10; the actives pair with their
    passive neighbours in turn, and the passives' gradients were computed at models that
    changed before they were applied (staleness)."""
    summary, state = results["async"]
    run_dir = pool.folder(__name__) / "async"
    x = replay(run_dir, summary["gossip_final_ops"])
    ours = torch.cat([state[k].reshape(-1) for k in state])
    assert (ours - x.mean(0)).abs().max().item() < 1e-10
    assert abs(summary["consensus_distance"] - ((x - x.mean(0)) ** 2).sum(1).mean().item()) < 1e-10
    assert [rec["partner"] for rec in records(run_dir, 0)[:4]] == [1, 3, 1, 3]  # rank 0's passive neighbours in turn
    assert all(rec["staleness"] == 1 for rec in records(run_dir, 2))  # its own average
    served = sum(len(rec.get("gossip_ops", [])) for rec in records(run_dir, 1))
    assert served + len(summary["gossip_final_ops"].get("1", [])) == STEPS  # half of each active's steps


def test_a_ddp_script_runs_under_both_modes_and_its_checkpoint_holds_worker_zeros_model(tmp_path):
    """convnet_psar.py (the doc's diff) under psar launch: D-PSGD and AD-PSGD train, report the
    consensus distance, and rank 0's checkpoint holds worker 0's model and optimizer, from
    which a resumed run starts every worker again."""
    from tests.process.test_ddp_contract import launched

    args = ["--float64", "--optimizer", "adamw", "--lr", "0.01", "--steps", "6"]
    for mode in ("sync", "async"):
        ckpt = tmp_path / f"{mode}.ckpt"
        launched("gossip", args + ["--save-at", "3", "--save", str(ckpt)], tmp_path / mode,
                 overrides=(f"gossip.mode={mode}",))
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert summary["consensus_distance"] > 0 and summary["engine"] == "gossip"
        saved = torch.load(ckpt, weights_only=True)
        assert saved["step"] == 3 and all(float(s["step"]) == 3 for s in saved["optimizer"]["state"].values())
    launched("gossip", args + ["--resume", str(ckpt)], tmp_path / "resumed", overrides=("gossip.mode=async",))


def _first_exchange_under_a_delay(rank: int, world: int, delay_s: float) -> dict:
    """attach() sends this worker's model (its own: as restored, seeded by its rank) to its
    neighbour: when it did (time.monotonic, one clock for every process of this machine), and
    when the neighbour's model was first all in this worker's buffer."""
    import time

    from allreduce.gossip import GossipEngine
    from allreduce.gossip_config import GossipConfig

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Linear(64, 1).double()

    engine = GossipEngine(rank, world, torch.device("cpu"), GossipConfig(), timeout_s=30, delay_s=delay_s)
    engine.keep_restored(0)
    peer = parameters_to_vector(model(1 - rank).parameters()).detach()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # its first import (1 s) before the clock
    sent = time.monotonic()
    engine.attach(model(rank), lambda params: torch.optim.SGD(params, lr=0.1))
    while not torch.equal(engine._inbox[0], peer) and time.monotonic() < sent + 30:
        time.sleep(0.002)
    seen = time.monotonic()
    engine._finish_exchange()
    assert torch.equal(engine._inbox[0], peer)
    engine.close()
    return {"sent": sent, "seen": seen}


@pytest.mark.timeout(120)
def test_an_injected_delay_holds_the_models_back_as_a_link_with_it_would():
    """net.latency_ms without netem: a model leaves the delay after its step ended, so that it
    arrives its transfer plus the delay after it was sent, as over a link whose every byte is
    that late (netem), not at whichever of the two is later (then it was in at once, and only
    its use waited)."""
    from spawn import run_ranks

    delay = 0.5
    got = run_ranks(_first_exchange_under_a_delay, 2, delay, group=False, timeout_s=90)
    for rank in (0, 1):
        assert got[rank]["seen"] - got[1 - rank]["sent"] >= delay, got
