"""Process-group set-up and state broadcast for the all-reduce engines."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .backward_state import BackwardStates


def init_process_group(device: torch.device, rank: int, world: int, timeout_s: float) -> str:
    """Join the torch.distributed job (env:// rendezvous: MASTER_ADDR, MASTER_PORT).

    Using env:// lets torchrun and Slurm launch the workers as they launch any PyTorch job.
    Returns the backend: NCCL on CUDA, Gloo on CPU.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    return backend


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> int:
    """Overwrite `tensors` in place with rank `src`'s values, one flat message per dtype.

    Returns the bytes broadcast.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    nbytes = 0
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        nbytes += flat.numel() * flat.element_size()
    return nbytes


def shutdown(backward_states: BackwardStates | None = None) -> None:
    """Leave the job after every rank has arrived, so no rank tears down a peer mid-message,
    and once this rank's backend threads have let go of the collectives started inside
    backward (see allreduce.backward_state)."""
    if dist.is_initialized():
        dist.barrier()
        if backward_states is not None:
            backward_states.wait_released(f"rank {dist.get_rank()}")
        dist.destroy_process_group()
