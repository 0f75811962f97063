"""Assignment of parameters to gradient buckets: a pure function, as in PyTorch DDP.

Gradients are produced roughly in reverse order of `model.parameters()`, so buckets are
filled in that reverse order; the first bucket is kept small so that its all-reduce starts
while most of backward is still running.
"""

from __future__ import annotations

from typing import Hashable, Sequence


def assign_buckets(
    sizes: Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    groups: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Return buckets of parameter indices, in the order their all-reduces are started.

    Args:
        sizes: bytes of each parameter's gradient, in `model.parameters()` order.
        cap_bytes: a bucket is closed once it holds at least this many bytes.
        first_cap_bytes: cap of the first bucket (default: `cap_bytes`).
        groups: a key per parameter (dtype, device); parameters of different keys never
            share a bucket, since one bucket is one flat tensor. Default: all one group.

    A parameter larger than the cap gets a bucket of its own; no bucket is empty; every
    index appears exactly once; indices inside a bucket are in reverse parameter order.
    """
    if cap_bytes <= 0 or (first_cap_bytes is not None and first_cap_bytes <= 0):
        raise ValueError(f"bucket caps must be > 0, got cap={cap_bytes} first={first_cap_bytes}")
    if groups is not None and len(groups) != len(sizes):
        raise ValueError(f"{len(groups)} group keys for {len(sizes)} parameters")
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"parameter {i} has negative size {size}")
    group_of = list(groups) if groups is not None else [None] * len(sizes)
    caps_used: dict[Hashable, int] = {}
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    buckets: list[list[int]] = []

    def cap_for(key: Hashable) -> int:
        first = caps_used.get(key, 0) == 0 and first_cap_bytes is not None
        return first_cap_bytes if first else cap_bytes

    for index in reversed(range(len(sizes))):
        key = group_of[index]
        members, filled = open_buckets.get(key, ([], 0))
        members.append(index)
        filled += sizes[index]
        if filled >= cap_for(key):
            buckets.append(members)
            caps_used[key] = caps_used.get(key, 0) + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, filled)
    # Partly filled buckets close last, in the order their first parameter became ready.
    buckets.extend(sorted((m for m, _ in open_buckets.values()), key=lambda m: -m[0]))
    return buckets
