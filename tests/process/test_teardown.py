"""Leaving a process group after collectives started inside backward holds no rank.

torch keeps a Python object in thread-local state during backward; the collectives started
there capture it, and the Gloo worker that drops one needs the GIL, which the process
group's destructor holds while it joins that worker (allreduce/backward_state.py). Before
the shutdown waited for those, a rank was held there about once in a few hundred jobs on a
loaded 2-core machine; `make stress` runs this file too.
"""

from __future__ import annotations

import os

import pytest
import torch
from spawn import run_ranks

from allreduce.backward_state import KEY, SUPPORTED, BackwardStates, held_elsewhere
from experiments.runtime.sites import free_port

needs_tls = pytest.mark.skipif(not SUPPORTED,
                               reason="this torch keeps no Python object in thread-local state during backward")

JOBS = int(os.environ.get("PSAR_TEARDOWN_JOBS", "24"))


@needs_tls
def test_an_object_in_torchs_thread_local_state_counts_as_held():
    obj = object()
    objs = [obj]
    del obj
    assert held_elsewhere(objs) == [False]
    torch._C._stash_obj_in_tls(KEY, objs[0])
    try:
        assert held_elsewhere(objs) == [True]
    finally:
        torch._C._remove_obj_from_tls(KEY)
    assert held_elsewhere(objs) == [False]


@needs_tls
def test_backward_notes_its_state_and_the_shutdown_waits_until_it_is_let_go():
    states = BackwardStates(timeout_s=0.05)
    w = torch.randn(3, requires_grad=True)
    states.backward((w * 2).sum())
    assert len(states._held) == 1 and w.grad is not None
    kept = states._held[0]  # a holder that never lets go
    with pytest.raises(RuntimeError, match=r"rank 7: .* still hold collectives .* after 0 s"):
        states.wait_released("rank 7")
    del kept
    states.wait_released("rank 7")
    assert states._held == []


def _one_job(rank: int, world: int, engine_name: str) -> float:
    """One short job, its engine and model let go of when this returns, as train() does."""
    from allreduce.config import AllReduceConfig
    from allreduce.ddp import DDPEngine
    from allreduce.engine import AllReduceEngine

    cls = DDPEngine if engine_name == "ddp" else AllReduceEngine
    engine = cls(rank, world, torch.device("cpu"), AllReduceConfig(bucket_cap_mb=0.001), timeout_s=30)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 10))
    module = engine.attach(model, lambda params: torch.optim.SGD(params, lr=0.1))
    for step in range(2):
        torch.manual_seed(rank * 100 + step)
        engine.backward(module(torch.randn(4, 1, 8, 8)).square().mean())
        engine.step()
    engine.close()
    return float(model[3].weight.double().sum())


def _jobs_in_a_row(rank: int, world: int, ports: list[int]) -> list[float]:
    out = []
    for i, port in enumerate(ports):
        os.environ["MASTER_PORT"] = str(port)  # each job meets on its own port, as batches do
        out.append(_one_job(rank, world, "ddp" if i % 2 == 0 else "allreduce"))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_ddp_and_allreduce_jobs_one_after_another_in_one_process_never_hold_a_rank():
    ranks = run_ranks(_jobs_in_a_row, 2, [free_port() for _ in range(JOBS)], timeout_s=120, group=False)
    assert len(ranks[0]) == JOBS and ranks[0] == ranks[1]  # every job ended, alike on both ranks
