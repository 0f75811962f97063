"""Tree all-reduce over point-to-point messages: a binomial tree reduces the whole tensor to
rank 0 (each rank adds its children's tensors, then sends the sum to its parent), and the
same tree broadcasts the result back down.

2 ceil(log2 N) steps on the longest path (the ring: 2(N-1)), but every step carries the whole
tensor: the algorithm of small messages and high latency (NCCL's "low latency" choice). Any
world size: a binomial tree needs no power of two. Not pipelined in pieces (a step's whole
tensor is one message); the ring pipelines where bandwidth matters. Plans: allreduce/steps.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .steps import Step, execute, planned_bytes


def plan(numel: int, rank: int, world: int) -> list[Step]:
    """Rank `rank`'s steps: receive and add each child's sum (children rank + 1, + 2, + 4, ...
    below the lowest set bit of rank), send to the parent (rank without that bit), then take
    the result from the parent and pass it to the children, the farthest first."""
    whole, none = (0, numel), (0, 0)
    steps, children, parent = [], [], None
    mask = 1
    while mask < world:
        if rank & mask:
            parent = rank - mask
            steps.append(Step(parent, whole, none, False))
            break
        if rank + mask < world:
            children.append(rank + mask)
            steps.append(Step(rank + mask, none, whole, True))
        mask <<= 1
    if parent is not None:
        steps.append(Step(parent, none, whole, False))
    for i, child in enumerate(reversed(children)):
        # the root rounds the sum to the wire dtype before it leaves, so every rank ends alike
        steps.append(Step(child, whole, none, False, whole if parent is None and i == 0 else None))
    return steps


def tree_allreduce(flat: torch.Tensor, rank: int, world: int, wire_dtype: torch.dtype | None = None,
                   group: dist.ProcessGroup | None = None, delay_s: float = 0.0) -> tuple[int, int]:
    """Sum the 1-D tensor `flat` in place over the ranks; return (bytes sent, received)."""
    return execute(plan(flat.numel(), rank, world), flat, wire_dtype, group, delay_s)


def sent_bytes(numel: int, itemsize: int, rank: int, world: int) -> int:
    """What rank `rank` sends for a tensor of numel elements of itemsize bytes."""
    return planned_bytes(plan(numel, rank, world), itemsize)
