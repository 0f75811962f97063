"""The halving-doubling and tree all-reduces' plans, run without processes: every rank's
steps meet their peers', and the sum comes out on every rank, for every world size (powers
of two and not) and uneven lengths; their steps and bytes against the algorithms'."""

from __future__ import annotations

import pytest
import torch

from allreduce import tree
from allreduce.halving import plan, sent_bytes

LENGTHS = (0, 1, 2, 3, 5, 7, 100, 101)


def simulate(values: list[torch.Tensor], plan=plan) -> list[torch.Tensor]:
    """Run every rank's plan, exchanging whenever two ranks' next steps name each other."""
    world = len(values)
    flats = [v.clone() for v in values]
    plans = [plan(v.numel(), r, world) for r, v in enumerate(values)]
    at = [0] * world
    while any(at[r] < len(plans[r]) for r in range(world)):
        moved = False
        for i in range(world):
            if at[i] == len(plans[i]):
                continue
            step = plans[i][at[i]]
            j = step.peer
            if j > i and at[j] < len(plans[j]) and plans[j][at[j]].peer == i:
                other = plans[j][at[j]]
                for me, them, mine, theirs in ((i, j, step, other), (j, i, other, step)):
                    assert (mine.recv[1] - mine.recv[0]) == (theirs.send[1] - theirs.send[0])
                sent = {i: flats[i][step.send[0]:step.send[1]].clone(), j: flats[j][other.send[0]:other.send[1]].clone()}
                for me, them, mine in ((i, j, step), (j, i, other)):
                    r0, r1 = mine.recv
                    if mine.add:
                        flats[me][r0:r1] += sent[them]
                    else:
                        flats[me][r0:r1] = sent[them]
                at[i] += 1
                at[j] += 1
                moved = True
        assert moved, "the plans deadlock"
    return flats


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("algorithm", ["halving-doubling", "tree"])
def test_every_rank_ends_with_the_sum(world, algorithm):
    for numel in LENGTHS:
        values = [torch.randn(numel, generator=torch.Generator().manual_seed(10 * r + numel), dtype=torch.float64)
                  for r in range(world)]
        expected = sum(values)
        for flat in simulate(values, plan if algorithm == "halving-doubling" else tree.plan):
            torch.testing.assert_close(flat, expected, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_power_of_two_takes_2_log2_p_steps_and_the_rings_bytes(world):
    numel = 1024
    for rank in range(world):
        assert len(plan(numel, rank, world)) == 2 * (world.bit_length() - 1)
        assert sent_bytes(numel, 4, rank, world) == 2 * (world - 1) * numel * 4 // world


def test_a_folded_rank_sends_the_whole_tensor_once_and_gets_the_sum_back():
    steps = plan(100, 0, 5)  # p = 4, r = 1: rank 0 folds into rank 1
    assert [(s.peer, s.send, s.recv) for s in steps] == [(1, (0, 100), (0, 0)), (1, (0, 0), (0, 100))]
    assert sent_bytes(100, 8, 0, 5) == 800 and sent_bytes(100, 8, 1, 5) == 800 + 2 * 3 * 100 * 8 // 4


@pytest.mark.parametrize("world", [2, 5, 8])
def test_the_tree_sends_the_whole_tensor_once_up_and_once_to_each_child(world):
    for rank in range(world):
        steps = tree.plan(100, rank, world)
        children = sum(1 for s in steps if s.send == (0, 100) and s.recv == (0, 0)) - (rank != 0)
        assert tree.sent_bytes(100, 8, rank, world) == 800 * (children + (rank != 0))
    assert max(len([s for s in tree.plan(100, r, world) if s.recv != (0, 0)]) for r in range(world)) <= \
        2 * (world - 1).bit_length()
