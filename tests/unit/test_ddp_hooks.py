"""torch's powerSGD_hook on CPU buckets of a host with CUDA, where torch 2.11 raised.

The training runs in a process of its own, under a deadline, which says it trained before it
leaves with os._exit: in one full suite the Gloo group's destructor blocked for good on a mutex
(native code, which pytest's timeout cannot interrupt), and in another a native thread aborted the
process at its exit ("terminate called without an active exception") after the training."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from allreduce.ddp import synchronize_passes_cpu

DEADLINE_S = 120

REACHED: list = []


def cuda_host_synchronize(device=None):
    """torch.cuda.synchronize as torch 2.11 has it on a host with CUDA."""
    REACHED.append(device)
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {torch.device(device)}")


def _train_on_a_fake_cuda_host() -> None:
    """In a fresh process: torch.cuda says it is there, and synchronize refuses a CPU device
    as torch 2.11's does; DDP with the PowerSGD hook trains once synchronize_passes_cpu."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hooks
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.is_available = lambda: True
    torch.cuda.synchronize = cuda_host_synchronize
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.synchronize(torch.device("cpu"))
    synchronize_passes_cpu()
    synchronize_passes_cpu()  # idempotent: one wrapper
    wrapper, asked = torch.cuda.synchronize, []
    assert wrapper.passes_cpu
    torch.cuda.synchronize = lambda device=None: (asked.append(device), wrapper(device))[1]

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # left to os._exit
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)))
    model.register_comm_hook(hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                 start_powerSGD_iter=2, min_compression_rate=0.1),
                             hooks.powerSGD_hook)
    for _ in range(4):  # compressed (decompress synchronizes the bucket's device) from the third
        model(torch.randn(4, 16)).sum().backward()
    assert [torch.device(d).type for d in asked] == ["cpu", "cpu"]  # the hook did ask, and passed
    assert REACHED == [torch.device("cpu")]  # only the check above reached torch's own
    wrapper(torch.device("cuda", 0))  # a CUDA device still does
    assert REACHED[-1] == torch.device("cuda", 0)


def _child(conn) -> None:
    """The training, its answer on conn, and an exit that runs no native destructor."""
    try:
        _train_on_a_fake_cuda_host()
        conn.send("trained")
    except BaseException:
        conn.send(traceback.format_exc())
    finally:
        conn.close()
        os._exit(0)


@pytest.mark.multiprocess
def test_powersgd_on_cpu_trains_on_a_cuda_host_once_synchronize_passes_cpu():
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(theirs,))
    child.start()
    theirs.close()
    try:
        answer = ours.recv() if ours.poll(DEADLINE_S) else None
    except EOFError:  # it died without a word
        answer = None
    child.join(10)
    if child.is_alive():
        child.kill()
        child.join(10)
    assert answer is not None, f"the training ended or hung without an answer within {DEADLINE_S} s " \
        f"(exit code {child.exitcode}; its output is above)"
    assert answer == "trained", answer
