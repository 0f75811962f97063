"""allreduce.algorithm=auto's choice: the alpha-beta model of each algorithm, and where each
wins (many steps lose on latency, whole-tensor steps lose on bandwidth)."""

from __future__ import annotations

import pytest

from allreduce.auto import ALGORITHMS, MESSAGE_S, choose, crowding, pieces, predict


def test_the_model_of_each_algorithm():
    S, B, a = 8e6, 1e9, 1e-3
    assert predict("ring", S, 4, a, B) == pytest.approx(6 * (a + S / 4 / B))
    assert predict("halving-doubling", S, 4, a, B) == pytest.approx(4 * a + 1.5 * S / B)
    assert predict("halving-doubling", S, 5, a, B) == pytest.approx(4 * a + 1.5 * S / B + 2 * (a + S / B))
    assert predict("tree", S, 5, a, B) == pytest.approx(6 * (a + S / B))
    assert predict("ring", S, 1, a, B) == 0.0


@pytest.mark.parametrize("nbytes,world,delay_s,bandwidth,expected", [
    (64 * 1024, 8, 0.005, None, "tree"),               # 5 ms a round: 6 one-way hops against the ring's 14 exchanges
    (1 << 20, 8, 0.0, None, "halving-doubling"),       # the ring's bytes in 6 exchanges, not 14
    (64 << 20, 6, 0.0, None, "ring"),                  # 6 ranks: halving-doubling's fold moves whole tensors
    (64 << 20, 3, 0.0, 12.5e6, "ring"),                # 100mbit, 3 ranks: whole-tensor steps are the worst
])
def test_auto_picks_the_fastest_by_the_model(nbytes, world, delay_s, bandwidth, expected):
    assert choose(nbytes, world, delay_s, bandwidth) == expected
    b = bandwidth or 1.2e9
    n = pieces(nbytes)
    best = min(predict(a, nbytes, world, delay_s, b, npieces=n, per_message=MESSAGE_S) for a in ALGORITHMS)
    assert predict(expected, nbytes, world, delay_s, b, npieces=n, per_message=MESSAGE_S) == best


def test_the_tree_wins_small_messages_and_never_large_ones():
    """A tree's hop is one message to each rank it touches, an exchange two: where messages'
    fixed costs decide, the tree wins; its whole-tensor rounds lose wherever bytes decide."""
    for world in range(3, 17):
        assert choose(1024, world) == "tree" and choose(1024, world, 0.005) == "tree"
        assert choose(64 << 20, world) != "tree" and choose(16 << 20, world, 0.005) != "tree"


def test_ranks_that_share_cores_pay_more_per_message():
    assert crowding(8, cores=2) == 4.0 and crowding(1, cores=16) == 1.0
    # 256 KB on 8 ranks: at 4 ranks a core, halving-doubling's 12 messages a rank cost more
    # than the tree's whole-tensor hops, 6 messages a rank
    assert choose(256 << 10, 8) == "halving-doubling" and choose(256 << 10, 8, crowded=4) == "tree"


def test_plans_go_in_pieces_of_a_mebibyte_on_emulated_links_alone():
    """A plan's phases load different links (the tree's hops of the whole tensor, the racks'
    phases): smaller pieces fill the pipeline sooner. The ring loads every link at every
    hop; on loopback, and but for the tree where more than 2 ranks share a core, more pieces
    cost more than they save."""
    from allreduce.collective import ours
    from allreduce.tree import tree_allreduce

    for algorithm in ("tree", "halving-doubling", "hierarchical"):
        assert pieces(16 << 20, algorithm, emulated=True) == 16 and pieces(16 << 20, algorithm) == 4
    assert pieces(16 << 20, "ring", emulated=True) == 4
    assert pieces(16 << 20, "halving-doubling", True, crowded=2) == 16
    assert pieces(16 << 20, "halving-doubling", True, crowded=4) == 4 and pieces(16 << 20, "tree", True, crowded=4) == 16
    assert pieces(3 << 20, "tree", emulated=True) == 3  # pieces of 1 MiB or more
    assert pieces(64 << 20, "tree", emulated=True) == 64 and pieces(80 << 20, "tree", emulated=True) == 64
    assert ours("tree", emulated=True)[0].keywords == {"most_pieces": 64}
    assert ours("hierarchical", (0, 1), emulated=True)[1].keywords == {"most_pieces": 64}
    assert ours("tree")[0] is tree_allreduce and ours("ring", emulated=True)[0].__name__ == "ring_allreduce"
    # 4 ranks: a piece of s takes 4 rounds of s/B end to end; the root's link in carries two
    # children's pieces, 2s/B a piece after the first: (2 + 2/P) S/B in P pieces
    S, B = 16 << 20, 125e6
    assert predict("tree", S, 4, 0.0, B, npieces=4) == pytest.approx(2.5 * S / B)
    assert predict("tree", S, 4, 0.0, B, npieces=16) == pytest.approx(2.125 * S / B)
