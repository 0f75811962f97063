"""Our all-reduce algorithms besides the ring as plans: each rank's steps as plain data (a
peer, what it sends, what it receives and whether it adds or stores it), and one executor
over Gloo's (or NCCL's) point-to-point messages. A plan is tested without processes, and the
bytes a rank moves are known before any message is sent."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ring import scratch_buffer


@dataclass(frozen=True)
class Step:
    peer: int
    send: tuple[int, int]
    """Elements [a, b) of the tensor sent to peer ((0, 0): nothing)."""
    recv: tuple[int, int]
    """Elements [a, b) received from peer ((0, 0): nothing)."""
    add: bool
    """Whether what arrives is added (reduce) or stored (gather)."""
    round_owned: tuple[int, int] | None = None
    """Before this step, round these elements to the wire dtype (the segment this rank owns
    once the reduce-scatter is done), so every rank ends bit-identical."""


def execute(steps: list[Step], flat: torch.Tensor, wire_dtype: torch.dtype | None = None,
            group: dist.ProcessGroup | None = None, delay_s: float = 0.0) -> tuple[int, int]:
    """Run a rank's plan on the 1-D tensor `flat` (summed in place); return (bytes sent,
    received). wire_dtype: what travels (partial sums are kept in flat's dtype); delay_s: an
    injected latency paid once per step."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("an all-reduce needs a contiguous 1-D tensor")
    wire = wire_dtype or flat.dtype
    itemsize = torch.empty(0, dtype=wire).element_size()
    scratch = scratch_buffer(flat.numel(), wire, flat.device) if steps else None
    batched = flat.device.type != "cpu"
    moved = [0, 0]
    for step in steps:
        if delay_s:
            time.sleep(delay_s)
        if step.round_owned is not None and wire != flat.dtype:
            a, b = step.round_owned
            flat[a:b] = flat[a:b].to(wire)
        peer = step.peer if group is None else dist.get_global_rank(group, step.peer)
        (s0, s1), (r0, r1) = step.send, step.recv
        into = scratch[: r1 - r0] if (step.add or wire != flat.dtype) else flat[r0:r1]
        ops = []
        if s1 > s0:
            ops.append((dist.isend, flat[s0:s1].to(wire), peer))
            moved[0] += (s1 - s0) * itemsize
        if r1 > r0:
            ops.append((dist.irecv, into, peer))
            moved[1] += (r1 - r0) * itemsize
        if batched:
            works = dist.batch_isend_irecv([dist.P2POp(op, t, q, group) for op, t, q in ops]) if ops else []
        else:
            works = [op(t, q, group) for op, t, q in ops]
        for work in works:
            work.wait()
        if r1 > r0:
            if step.add:
                flat[r0:r1] += into
            elif into.data_ptr() != flat[r0:r1].data_ptr():
                flat[r0:r1] = into
    return moved[0], moved[1]




def planned_bytes(steps: list[Step], itemsize: int) -> int:
    """What a rank sends under its plan."""
    return sum(s.send[1] - s.send[0] for s in steps) * itemsize
