"""torch's powerSGD_hook on CPU buckets of a host with CUDA, where torch 2.11 raised."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from allreduce.ddp import synchronize_passes_cpu


REACHED: list = []


def cuda_host_synchronize(device=None):
    """torch.cuda.synchronize as torch 2.11 has it on a host with CUDA."""
    REACHED.append(device)
    if device is not None and torch.device(device).type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {torch.device(device)}")


def test_powersgd_on_cpu_trains_on_a_cuda_host_once_synchronize_passes_cpu(monkeypatch):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hooks
    from torch.nn.parallel import DistributedDataParallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", cuda_host_synchronize)
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.synchronize(torch.device("cpu"))
    synchronize_passes_cpu()
    synchronize_passes_cpu()  # idempotent: one wrapper
    wrapper, asked = torch.cuda.synchronize, []
    assert wrapper.passes_cpu
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (asked.append(device), wrapper(device))[1])

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)))
        model.register_comm_hook(hooks.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                     start_powerSGD_iter=2, min_compression_rate=0.1),
                                 hooks.powerSGD_hook)
        for _ in range(4):  # compressed (decompress synchronizes the bucket's device) from the third
            model(torch.randn(4, 16)).sum().backward()
    finally:
        dist.destroy_process_group()
    assert [torch.device(d).type for d in asked] == ["cpu", "cpu"]  # the hook did ask, and passed
    assert REACHED == [torch.device("cpu")]  # only the check above reached torch's own
    wrapper(torch.device("cuda", 0))  # a CUDA device still does
    assert REACHED[-1] == torch.device("cuda", 0)
