"""The halving-doubling and tree all-reduces' plans (the hierarchical one's: test_hierarchical.py), run without processes: every rank's
steps meet their peers', and the sum comes out on every rank, for every world size (powers
of two and not) and uneven lengths; their steps and bytes against the algorithms'."""

from __future__ import annotations

import pytest
import torch

from allreduce import tree
from allreduce.halving import plan, sent_bytes

from plans import LENGTHS, simulate


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
