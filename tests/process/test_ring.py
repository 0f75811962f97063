"""Our ring all-reduce equals the elementwise sum, for any world size and tensor length."""

from __future__ import annotations

import pytest
import torch

from allreduce.ring import MAX_PIECES, PIECE_BYTES, chunk_bounds, owner_chunk, ring_allreduce
from spawn import run_ranks

LENGTHS = (0, 1, 2, 3, 5, 7, 1000, 1001, 4099)
SHORT = (0, 1, 2, 3, 5, 7, 100, 101)


@pytest.mark.parametrize("numel,world", [(10, 3), (0, 2), (2, 4), (7, 7), (1001, 4), (5, 1)])
def test_chunk_bounds_cover_evenly(numel, world):
    bounds = chunk_bounds(numel, world)
    assert len(bounds) == world
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def _values(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel),
                       dtype=torch.float64)


def _ring_ranks(rank, world, wire, piece_bytes=PIECE_BYTES, lengths=LENGTHS):
    out = {}
    for numel in lengths:
        flat = _values(rank, numel)
        sent, received = ring_allreduce(flat, rank, world, wire, piece_bytes=piece_bytes)
        out[numel] = (flat.tolist(), sent, received)  # plain data crosses the queue
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,piece_bytes,lengths", [(2, PIECE_BYTES, LENGTHS), (3, 8, SHORT), (4, 40, LENGTHS)])
def test_ring_equals_elementwise_sum(world, piece_bytes, lengths):
    """Whole chunks, and chunks in pipelined pieces of a few elements (pieces of unequal
    length, and empty ones where a chunk has fewer elements than there are pieces)."""
    results = run_ranks(_ring_ranks, world, None, piece_bytes, lengths)
    for numel in lengths:
        expected = sum(_values(r, numel) for r in range(world))
        for rank in range(world):
            flat, sent, received = results[rank][numel]
            flat = torch.tensor(flat, dtype=torch.float64)
            torch.testing.assert_close(flat, expected, rtol=1e-14, atol=1e-14)
            # Bandwidth-optimal: every rank moves 2(N-1) chunks of about numel/N elements.
            assert abs(sent - 2 * (world - 1) * numel * 8 / world) <= 2 * (world - 1) * 8
        assert sum(results[r][numel][1] for r in range(world)) == sum(
            results[r][numel][2] for r in range(world))
        # Every rank ends with bit-identical values.
        assert all(results[0][numel][0] == results[r][numel][0] for r in range(world))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ring_with_fp16_wire_is_identical_on_every_rank():
    world = 3
    results = run_ranks(_ring_ranks, world, torch.float16, 64)
    for numel in LENGTHS:
        expected = sum(_values(r, numel) for r in range(world))
        flats = [torch.tensor(results[r][numel][0], dtype=torch.float64) for r in range(world)]
        assert all(torch.equal(flats[0], f) for f in flats)
        torch.testing.assert_close(flats[0], expected, rtol=1e-2, atol=1e-2)
        assert results[0][numel][1] <= 2 * (world - 1) * (numel // world + 1) * 2


def test_ring_on_one_rank_is_identity():
    flat = torch.arange(5, dtype=torch.float64)
    assert ring_allreduce(flat, 0, 1) == (0, 0)
    assert torch.equal(flat, torch.arange(5, dtype=torch.float64))


def test_ring_rejects_non_flat_tensor_and_empty_pieces():
    with pytest.raises(ValueError, match="1-D"):
        ring_allreduce(torch.zeros(2, 2), 0, 2)
    with pytest.raises(ValueError, match="piece_bytes"):
        ring_allreduce(torch.zeros(4), 0, 2, piece_bytes=0)


def _hd_ranks(rank, world, wire, lengths=LENGTHS, algorithm="halving-doubling", piece_bytes=PIECE_BYTES,
              racks=None, most_pieces=MAX_PIECES):
    from allreduce import hierarchical
    from allreduce.collective import PLANNED

    allreduce, sent_bytes = hierarchical.algorithm(racks) if racks else PLANNED[algorithm]
    out = {}
    for numel in lengths:
        flat = _values(rank, numel)
        sent, received = allreduce(flat, rank, world, wire, piece_bytes=piece_bytes, most_pieces=most_pieces)
        assert sent == sent_bytes(numel, 8 if wire is None else 2, rank, world, piece_bytes, most_pieces)
        out[numel] = (flat.tolist(), sent, received)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,algorithm,piece_bytes,racks", [
    (2, "halving-doubling", PIECE_BYTES, None), (3, "halving-doubling", 8, None), (4, "halving-doubling", 40, None),
    (5, "halving-doubling", PIECE_BYTES, None), (2, "tree", 8, None), (3, "tree", PIECE_BYTES, None),
    (5, "tree", 40, None), (4, "hierarchical", 40, (0, 1, 0, 1)), (5, "hierarchical", 8, (0, 0, 1, 1, 1)),
    (3, "hierarchical", PIECE_BYTES, (0, 1, 1)), (4, "tree-16", 8, None), (5, "hierarchical-16", 8, (0, 0, 1, 1, 1))])
def test_halving_doubling_tree_and_hierarchical_equal_elementwise_sum(world, algorithm, piece_bytes, racks):
    """Powers of two, and 3 and 5 ranks (halving-doubling: the first ranks fold into their
    neighbours; the tree: a binomial tree of any size; hierarchical: racks of 2 and 2, 2 and 3
    (one rank folds), 1 and 2), whole and in pipelined pieces of a few elements (up to 4, of
    unequal lengths; -16: up to 16, as on emulated links, more than run at once)."""
    most = 16 if algorithm.endswith("-16") else MAX_PIECES
    results = run_ranks(_hd_ranks, world, None, LENGTHS, algorithm.removesuffix("-16"), piece_bytes, racks, most)
    for numel in LENGTHS:
        expected = sum(_values(r, numel) for r in range(world))
        for rank in range(world):
            torch.testing.assert_close(torch.tensor(results[rank][numel][0], dtype=torch.float64), expected,
                                       rtol=1e-14, atol=1e-14)
        assert all(results[0][numel][0] == results[r][numel][0] for r in range(world))
        assert sum(results[r][numel][1] for r in range(world)) == sum(results[r][numel][2] for r in range(world))


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm,racks", [("halving-doubling", None), ("tree", None), ("hierarchical", (0, 1, 1))])
def test_halving_doubling_tree_and_hierarchical_in_fp16_end_bit_identical_on_every_rank(algorithm, racks):
    results = run_ranks(_hd_ranks, 3, torch.float16, (1000, 1001), algorithm, 100, racks)
    for numel in (1000, 1001):
        assert all(results[0][numel][0] == results[r][numel][0] for r in range(3))
        expected = sum(_values(r, numel) for r in range(3))
        torch.testing.assert_close(torch.tensor(results[0][numel][0], dtype=torch.float64), expected,
                                   rtol=5e-3, atol=5e-3)


def _halves(rank, world):
    """The ring's reduce-scatter alone, then its all-gather alone of the owned chunks."""
    out = {}
    for numel in (6, 12, 4099):
        flat = _values(rank, numel)
        sent_rs, _ = ring_allreduce(flat, rank, world, phase="reduce_scatter", piece_bytes=40)
        a, b = chunk_bounds(numel, world)[owner_chunk(rank, world)]
        owned = flat[a:b].tolist()
        mine = torch.full((numel,), float("nan"), dtype=torch.float64)
        mine[a:b] = flat[a:b]  # everything else of the buffer must come from the others
        sent_ag, _ = ring_allreduce(mine, rank, world, phase="all_gather", piece_bytes=40)
        out[numel] = (owned, mine.tolist(), sent_rs, sent_ag)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_rings_halves_reduce_scatter_to_the_owners_and_all_gather_their_chunks(world):
    results = run_ranks(_halves, world)
    for numel in (6, 12, 4099):
        expected = sum(_values(r, numel) for r in range(world))
        for rank in range(world):
            owned, gathered, sent_rs, sent_ag = results[rank][numel]
            a, b = chunk_bounds(numel, world)[owner_chunk(rank, world)]
            torch.testing.assert_close(torch.tensor(owned, dtype=torch.float64), expected[a:b], rtol=1e-14, atol=1e-14)
            torch.testing.assert_close(torch.tensor(gathered, dtype=torch.float64), expected, rtol=1e-14, atol=1e-14)
            # each half moves (N-1) chunks of about numel/N elements
            assert abs(sent_rs - (world - 1) * numel * 8 / world) <= (world - 1) * 8
            assert abs(sent_ag - (world - 1) * numel * 8 / world) <= (world - 1) * 8
        assert all(results[0][numel][1] == results[r][numel][1] for r in range(world))
