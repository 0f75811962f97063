"""The gossip graphs (allreduce/topology.py): every W doubly stochastic, the static ones
symmetric with Metropolis-Hastings weights, and one-peer exponential mixing exactly after
log2 N steps when N is a power of two."""

from __future__ import annotations

import pytest
import torch

from allreduce.topology import TOPOLOGIES, grid, matrix, neighbours, peers


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 8, 9, 12])
def test_every_mixing_matrix_is_doubly_stochastic_and_sent_where_received(topology, world):
    for step in range(4):
        w = torch.tensor(matrix(topology, world, step), dtype=torch.float64)
        assert (w >= 0).all()
        assert torch.allclose(w.sum(0), torch.ones(world, dtype=torch.float64), atol=1e-15)
        assert torch.allclose(w.sum(1), torch.ones(world, dtype=torch.float64), atol=1e-15)
        for i in range(world):  # i receives from j exactly where j sends to i, and mixes what it receives
            to, _ = peers(topology, i, world, step)
            for j in range(world):
                assert (i in peers(topology, j, world, step)[0]) == (j in peers(topology, i, world, step)[1])
            assert {j for j in range(world) if j != i and w[i, j] > 0} == set(peers(topology, i, world, step)[1])
            assert len(to) == len(peers(topology, i, world, step)[1])


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "complete"])
def test_static_graphs_are_symmetric_with_metropolis_hastings_weights(topology):
    world = 6
    w = torch.tensor(matrix(topology, world, 0), dtype=torch.float64)
    assert torch.equal(w, w.T)
    for i in range(world):
        d = len(neighbours(topology, i, world))
        assert all(w[i, j] == 1 / (1 + d) for j in neighbours(topology, i, world))


def test_the_graphs_degrees():
    assert neighbours("ring", 0, 8) == [1, 7]
    assert grid(12) == (3, 4) and neighbours("torus", 5, 12) == [1, 4, 6, 9]
    assert grid(7) == (1, 7) and neighbours("torus", 0, 7) == [1, 6]  # a prime N: a ring
    assert neighbours("exponential", 0, 8) == [1, 2, 4, 6, 7]
    assert peers("one-peer-exponential", 0, 8, 0) == ([1], [7])
    assert peers("one-peer-exponential", 0, 8, 2) == ([4], [4])
    assert peers("one-peer-exponential", 0, 8, 3) == ([1], [7])  # period log2 8 = 3


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_one_peer_exponential_averages_exactly_over_log2_n_steps(world):
    product = torch.eye(world, dtype=torch.float64)
    for step in range(world.bit_length() - 1):
        product = torch.tensor(matrix("one-peer-exponential", world, step), dtype=torch.float64) @ product
    assert torch.allclose(product, torch.full((world, world), 1 / world, dtype=torch.float64), atol=1e-15)
