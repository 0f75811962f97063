"""Ring all-reduce over point-to-point send/recv: reduce-scatter, then all-gather.

Each of the N ranks sends and receives 2(N-1) chunks of about 1/N of the tensor, so every
link carries 2(N-1)/N of the bytes whatever N is: the bandwidth-optimal algorithm.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Split `numel` elements into `world` contiguous chunks whose sizes differ by at most one."""
    if world < 1 or numel < 0:
        raise ValueError(f"cannot split {numel} elements over {world} ranks")
    base, extra = divmod(numel, world)
    bounds, start = [], 0
    for i in range(world):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_allreduce(
    flat: torch.Tensor,
    rank: int,
    world: int,
    wire_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    delay_s: float = 0.0,
) -> tuple[int, int]:
    """Sum the 1-D tensor `flat` in place over the ranks of `group`; return (bytes sent, received).

    With `wire_dtype` the chunks travel in that dtype (compression) and partial sums are
    accumulated in `flat`'s own dtype; the reduced chunk is rounded to the wire dtype on its
    owner too, so every rank ends with bit-identical values. `delay_s` is an injected
    latency paid before every message.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("ring_allreduce needs a contiguous 1-D tensor")
    if world == 1:
        return 0, 0
    wire = wire_dtype or flat.dtype
    bounds = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        right = dist.get_global_rank(group, right)
        left = dist.get_global_rank(group, left)
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=wire, device=flat.device)
    sent = received = 0

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        nonlocal sent, received
        s0, s1 = bounds[send_idx]
        r0, r1 = bounds[recv_idx]
        incoming = scratch[: r1 - r0]
        ops = []
        if s1 > s0:
            ops.append(dist.P2POp(dist.isend, flat[s0:s1].to(wire), right, group))
            sent += (s1 - s0) * incoming.element_size()
        if r1 > r0:
            ops.append(dist.P2POp(dist.irecv, incoming, left, group))
            received += (r1 - r0) * incoming.element_size()
        if ops:
            if delay_s:
                time.sleep(delay_s)
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return incoming

    for s in range(world - 1):
        recv_idx = (rank - s - 1) % world
        incoming = exchange((rank - s) % world, recv_idx)
        r0, r1 = bounds[recv_idx]
        flat[r0:r1] += incoming
    owned = (rank + 1) % world
    if wire != flat.dtype:
        o0, o1 = bounds[owned]
        flat[o0:o1] = flat[o0:o1].to(wire)
    for s in range(world - 1):
        recv_idx = (rank - s) % world
        incoming = exchange((rank - s + 1) % world, recv_idx)
        r0, r1 = bounds[recv_idx]
        flat[r0:r1] = incoming
    return sent, received
