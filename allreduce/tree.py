"""Tree all-reduce over point-to-point messages: a binomial tree reduces the whole tensor to
rank 0 (each rank adds its children's tensors, then sends the sum to its parent), and the
same tree broadcasts the result back down.

2 ceil(log2 N) steps on the longest path (the ring: 2(N-1)), but every step carries the whole
tensor: the algorithm of small messages and high latency (NCCL's "low latency" choice). Any
world size: a binomial tree needs no power of two. Pipelined in pieces as the ring is (the
tensor in pieces of PIECE_BYTES or more, each running the whole tree: at most MAX_PIECES, and
on emulated links up to auto.LINK_PIECES, as a whole tensor crosses every hop), so a
piece goes down the tree while the next comes up. Plans: allreduce/steps.py.
"""

from __future__ import annotations

from .steps import Step, planned


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


tree_allreduce, sent_bytes = planned(plan)
