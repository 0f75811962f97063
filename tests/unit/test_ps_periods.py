"""How often a parameter-server worker communicates, shards serving in threads, each engine
against a few-line reference in float64: Downpour (ps.push_every, ps.fetch_every) and elastic
averaging (ps-easgd).

Downpour: A worker steps its
own SGD with momentum on each gradient, pushes the sum of its gradients since the last push
every push_every steps, and every fetch_every steps takes the shards' values; the shards run
SGD with momentum on the pushes (the mean of the workers' sums under sync)."""

from __future__ import annotations

import pytest
import torch

from ps.config import PSConfig
from ps.engine import PSEngine
from ps.layout import ParamSpec, build_layout, join_values
from ps.local import LocalCluster
from test_ps_cluster import run_workers

FAST = dict(timeout_s=10.0, heartbeat_s=0.05, worker_timeout_s=5.0)
F64 = torch.float64


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batch(worker: int, step: int):
    g = torch.Generator().manual_seed(100 * worker + step)
    return torch.randn(5, 6, generator=g, dtype=F64), torch.randn(5, 1, generator=g, dtype=F64)


def loss(m, worker, step):
    x, y = batch(worker, step)
    return torch.nn.functional.mse_loss(m(x), y)


def engines_run(mode: str, workers: int, steps: int, push: int, fetch: int) -> list[torch.Tensor]:
    """Each worker's final parameters (flat), and the shards' (last) after every worker left."""
    m0 = model()
    specs = [ParamSpec.of(n, p) for n, p in m0.named_parameters()]
    layout = build_layout(specs, 2, 16)
    cfg = PSConfig(push_every=push, fetch_every=fetch, async_scale="sum", **FAST)
    out: dict[int, torch.Tensor] = {}
    with LocalCluster(layout, [p.detach() for p in m0.parameters()], sgd, mode, workers, cfg) as cluster:
        def work(w):
            m = model()
            engine = PSEngine(w, workers, torch.device("cpu"), cluster.addresses, mode, cfg)
            engine.attach(m, sgd)
            for step in range(steps):
                engine.backward(loss(m, w, step))
                engine.step()
            out[w] = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
            engine.close()

        run_workers(work, workers)
        chunks = {k: t for server in cluster.servers for k, t in server.chunks.items()}
        final = torch.cat([p.reshape(-1) for p in join_values(layout, chunks)])
    return [out[w] for w in range(workers)] + [final]


def reference(workers: int, steps: int, push: int, fetch: int, sync: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Downpour in a few lines (one worker at a time under async: their steps do not overlap)."""
    center = model()
    server = sgd(center.parameters())
    replicas = [model() for _ in range(workers)]
    local = [sgd(r.parameters()) for r in replicas]
    summed = [None] * workers
    for step in range(steps):
        pushes = []
        for w, r in enumerate(replicas):
            r.zero_grad()
            loss(r, w, step).backward()
            g = [p.grad.clone() for p in r.parameters()]
            summed[w] = g if summed[w] is None else [a + b for a, b in zip(summed[w], g)]
            local[w].step()
            if (step + 1) % push == 0:
                pushes.append(summed[w])
                summed[w] = None
                if not sync:  # applied on arrival
                    server.zero_grad()
                    for p, gp in zip(center.parameters(), pushes.pop()):
                        p.grad = gp
                    server.step()
            if not sync and (step + 1) % fetch == 0:
                with torch.no_grad():
                    for p, c in zip(r.parameters(), center.parameters()):
                        p.copy_(c)
        if sync and pushes:
            for p, *gs in zip(center.parameters(), *pushes):
                p.grad = sum(gs) / workers
            server.step()
            with torch.no_grad():
                for r in replicas:
                    for p, c in zip(r.parameters(), center.parameters()):
                        p.copy_(c)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    return [flat(r) for r in replicas], flat(center)


@pytest.mark.timeout(60)
def test_sync_downpour_rounds_end_as_the_reference():
    *ours, shards = engines_run("sync", 2, 9, 3, 3)
    theirs, center = reference(2, 9, 3, 3, sync=True)
    assert torch.allclose(shards, center, rtol=0, atol=1e-12)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert not torch.allclose(center, reference(2, 9, 1, 1, sync=True)[1], rtol=0, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("push,fetch", [(2, 3), (3, 1), (1, 1)])
def test_async_downpour_of_one_worker_ends_as_the_reference(push, fetch):
    """One worker, so the order of pushes is known; pushes summed over `push` steps, values
    fetched every `fetch` steps, local steps between. (1, 1) is the plain ps-async update."""
    (ours, shards) = engines_run("async", 1, 12, push, fetch)
    (theirs,), center = reference(1, 12, push, fetch, sync=False)
    assert torch.allclose(shards, center, rtol=0, atol=1e-12)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alpha,tau", [(0.3, 3), (0.5, 1)])
def test_easgd_ends_as_the_reference(alpha, tau):
    """One worker steps SGD with momentum on its own model; every tau steps it and the centre
    move towards each other by alpha times their difference. The shards' centre and the
    worker's model end as the reference's."""
    from ps.easgd import EASGDEngine, shard_optimizer

    steps = 10
    m0 = model()
    layout = build_layout([ParamSpec.of(n, p) for n, p in m0.named_parameters()], 2, 16)
    cfg = PSConfig(async_scale="sum", easgd_alpha=alpha, easgd_tau=tau, **FAST)
    with LocalCluster(layout, [p.detach() for p in m0.parameters()], shard_optimizer, "async", 1, cfg) as cluster:
        m = model()
        engine = EASGDEngine(0, 1, torch.device("cpu"), cluster.addresses, cfg)
        engine.attach(m, sgd)
        for step in range(steps):
            engine.backward(loss(m, 0, step))
            engine.step()
        mine = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
        engine.close()  # worker 0 reads the centre into its model
        centre = torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    x, c = model(), model()
    opt = sgd(x.parameters())
    for step in range(steps):
        x.zero_grad()
        loss(x, 0, step).backward()
        opt.step()
        if (step + 1) % tau == 0:
            with torch.no_grad():
                for p, q in zip(x.parameters(), c.parameters()):
                    d = alpha * (p - q)
                    p.sub_(d)
                    q.add_(d)
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    assert torch.allclose(mine, flat(x), rtol=0, atol=1e-12)
    assert torch.allclose(centre, flat(c), rtol=0, atol=1e-12)
    assert not torch.allclose(flat(c), flat(model()), rtol=0, atol=1e-3)  # the centre moved
