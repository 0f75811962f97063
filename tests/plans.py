"""All-reduce plans (allreduce/steps.py) run on tensors without processes."""

from __future__ import annotations

import torch

from allreduce.plancost import rounds

LENGTHS = (0, 1, 2, 3, 5, 7, 100, 101)
"""Tensor lengths the plan tests try: empty, shorter than the ranks, uneven."""


def simulate(values: list[torch.Tensor], plan) -> list[torch.Tensor]:
    """Run every rank's plan round by round (allreduce/plancost.py's rendezvous messages; a
    deadlock raises there), each round's messages taken before any lands."""
    world = len(values)
    flats = [v.clone() for v in values]
    for moves in rounds([plan(v.numel(), r, world) for r, v in enumerate(values)]):
        sent = [(j, theirs, flats[i][mine.send[0]:mine.send[1]].clone()) for i, j, mine, theirs in moves]
        for j, theirs, data in sent:
            r0, r1 = theirs.recv
            if theirs.add:
                flats[j][r0:r1] += data
            else:
                flats[j][r0:r1] = data
    return flats
