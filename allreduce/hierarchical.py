"""Hierarchical all-reduce (Horovod's hierarchical and 2D all-reduce, BytePS's reduce inside
the machine first): ranks are grouped by rack (or host), and only 1/k of the tensor per rank
crosses the racks' uplinks.

With R racks of k ranks each:

1. a ring reduce-scatter inside each rack (k-1 steps): local member i ends holding segment i
   of the rack's sum, 1/k of the tensor;
2. a ring all-reduce of that segment among the R members with local index i, one per rack
   (2(R-1) steps): every uplink carries 2(R-1)/R of the tensor each way, the same as a flat
   ring placed rack by rack, where a ring placed round-robin crosses the uplink at every
   hop (k times as much);
3. a ring all-gather inside each rack (k-1 steps).

Racks of unequal size fold first, as halving-doubling folds a world that is not a power of
two: with k the smallest rack's size, a rack's members beyond its first k send their whole
tensor to member (index mod k) of their rack, wait, and get the result back from it; the
algorithm runs on the first k members of every rack. A rack of one makes every phase but the
cross-rack all-reduce empty, and one rack makes it a flat ring.

Pipelined in pieces as the ring is (allreduce/steps.py; on emulated links in up to
auto.LINK_PIECES pieces); `plan_for(racks)` gives the plans.
"""

from __future__ import annotations

from functools import lru_cache

from . import ringplan
from .ring import chunk_bounds
from .steps import Step, planned


def _members(racks: tuple[int, ...]) -> list[list[int]]:
    """The ranks of each rack, in rank order; racks by their first rank."""
    order: dict[int, list[int]] = {}
    for rank, rack in enumerate(racks):
        order.setdefault(rack, []).append(rank)
    return list(order.values())


@lru_cache(maxsize=16)
def plan_for(racks: tuple[int, ...]):
    """The plan(numel, rank, world) of the hierarchical all-reduce where rank r is in rack
    racks[r] (any labels)."""
    groups = _members(racks)
    k = min(len(g) for g in groups)

    def plan(numel: int, rank: int, world: int) -> list[Step]:
        if world != len(racks):
            raise ValueError(f"a hierarchical plan for {len(racks)} ranks asked for {world}")
        whole, none = (0, numel), (0, 0)
        rack = next(g for g in groups if rank in g)
        index = rack.index(rank)
        if index >= k:  # folded: the whole tensor to its partner, the sum back from it
            partner = rack[index % k]
            return [Step(partner, whole, none, False), Step(partner, none, whole, False)]
        extras = rack[k + index::k]
        steps = [Step(x, none, whole, True) for x in extras]
        core = rack[:k]
        segments = chunk_bounds(numel, k)
        steps += ringplan.reduce_scatter(core, index, segments)
        mine = ringplan.owned(index, segments)
        peers = [g[index] for g in groups]  # one per rack, this rank's rack in place
        sub = [(mine[0] + a, mine[0] + b) for a, b in chunk_bounds(mine[1] - mine[0], len(peers))]
        at = groups.index(rack)
        steps += ringplan.reduce_scatter(peers, at, sub) + ringplan.all_gather(peers, at, sub)
        gather = ringplan.all_gather(core, index, segments)
        if gather:  # the segment is whole now: round all of it before it leaves
            gather[0] = Step(gather[0].peer, gather[0].send, gather[0].recv, False, mine, gather[0].src)
        steps += gather
        steps += [Step(x, whole, none, False, whole if j == 0 else None) for j, x in enumerate(extras)]
        return steps

    return plan


@lru_cache(maxsize=16)
def algorithm(racks: tuple[int, ...]):
    """(all-reduce, sent_bytes) of the hierarchical all-reduce over `racks` (allreduce/steps.py)."""
    return planned(plan_for(racks))
