"""The ring as a plan (allreduce/steps.py): its reduce-scatter and all-gather over any list of
ranks, for the cost model (allreduce/costmodel.py) and as phases of the hierarchical
all-reduce. The ring that runs (allreduce/ring.py) sends the same bytes to the same peers."""

from __future__ import annotations

from .ring import chunk_bounds
from .steps import Step


def reduce_scatter(members: list[int], i: int, segments: list[tuple[int, int]]) -> list[Step]:
    """Member i's steps of a ring reduce-scatter of `segments` (one per member) over
    `members`: step s sends segment i-s right and adds segment i-s-1 from the left; member i
    ends owning segment i+1 (mod the ring)."""
    k = len(members)
    right, left = members[(i + 1) % k], members[(i - 1) % k]
    return [Step(right, segments[(i - s) % k], segments[(i - s - 1) % k], True, src=left) for s in range(k - 1)]


def all_gather(members: list[int], i: int, segments: list[tuple[int, int]]) -> list[Step]:
    """Member i's steps of the ring all-gather that follows reduce_scatter: it sends the
    segment it owns first (rounded to the wire dtype before it leaves), then passes each
    segment that arrives."""
    k = len(members)
    right, left = members[(i + 1) % k], members[(i - 1) % k]
    owned = segments[(i + 1) % k]
    return [Step(right, segments[(i + 1 - s) % k], segments[(i - s) % k], False, owned if s == 0 else None, src=left)
            for s in range(k - 1)]


def owned(i: int, segments: list[tuple[int, int]]) -> tuple[int, int]:
    """The segment member i holds reduced once reduce_scatter is done."""
    return segments[(i + 1) % len(segments)]


def plan(numel: int, rank: int, world: int) -> list[Step]:
    """allreduce/ring.py's ring over ranks 0..world-1 in order, as a plan."""
    if world == 1:
        return []
    members, segments = list(range(world)), chunk_bounds(numel, world)
    return reduce_scatter(members, rank, segments) + all_gather(members, rank, segments)
