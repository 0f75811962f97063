"""Halving-doubling all-reduce (Rabenseifner; Gloo's halving-doubling) over point-to-point
send/recv: recursive halving reduce-scatter, then recursive doubling all-gather.

On p = 2^k ranks each takes 2 log2(p) steps, the ring's 2(p-1), and moves 2(p-1)/p of the
tensor like the ring: fewer steps win where each message pays a latency. A world that is not
a power of two folds first (MPICH's way): with p the largest power of two below it and
r = world - p, ranks 0..2r-1 pair up, each even one sends its whole tensor to the odd one
above it and waits; the p ranks left (the odd ones below 2r, every one from 2r) run the
algorithm, and each odd one sends the result back to its partner. The folded ranks move the
whole tensor twice, their partners twice more.

Pipelined in pieces as the ring is: the tensor is cut into pieces of PIECE_BYTES or more (at
most MAX_PIECES; on emulated links up to auto.LINK_PIECES), each running the whole plan, and
a piece's next step leaves as soon as its last one is done (allreduce/steps.py).

`plan(numel, rank, world)` lists a rank's steps (allreduce/steps.py).
"""

from __future__ import annotations

from .steps import Step, planned


def _folding(world: int) -> tuple[int, int]:
    """(p, r): the largest power of two p <= world, and r = world - p."""
    p = 1 << (world.bit_length() - 1)
    return p, world - p


def plan(numel: int, rank: int, world: int) -> list[Step]:
    """The steps of rank `rank` (see the module's docstring)."""
    if world == 1:
        return []
    p, r = _folding(world)
    whole = (0, numel)
    if rank < 2 * r and rank % 2 == 0:  # folded: give the tensor to rank + 1, get the sum back
        return [Step(rank + 1, whole, (0, 0), False), Step(rank + 1, (0, 0), whole, False)]
    steps = [Step(rank - 1, (0, 0), whole, True)] if rank < 2 * r else []
    v = rank // 2 if rank < 2 * r else rank - r

    def real(u: int) -> int:
        return 2 * u + 1 if u < r else u + r

    lo, hi, segments = 0, numel, []
    mask = p // 2
    while mask:  # recursive halving: keep half the segment, send the other half
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if not v & mask else ((mid, hi), (lo, mid))
        steps.append(Step(real(v ^ mask), give, keep, True))
        segments.append((lo, hi))
        lo, hi = keep
        mask //= 2
    owned = (lo, hi)
    mask, first = 1, True
    while mask < p:  # recursive doubling: the segments come back in the reverse order
        outer = segments.pop()
        theirs = (outer[0], lo) if lo > outer[0] else (hi, outer[1])
        steps.append(Step(real(v ^ mask), (lo, hi), theirs, False, owned if first else None))
        first = False
        lo, hi = outer
        mask *= 2
    if rank < 2 * r:
        steps.append(Step(rank - 1, whole, (0, 0), False, owned if first else None))
    return steps


halving_doubling_allreduce, sent_bytes = planned(plan)
