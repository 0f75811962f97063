"""allreduce.algorithm=auto's choice: the alpha-beta model of each algorithm, and where each
wins (many steps lose on latency, whole-tensor steps lose on bandwidth)."""

from __future__ import annotations

import pytest

from allreduce.auto import MESSAGE_S, choose, predict


def test_the_model_of_each_algorithm():
    S, B, a = 8e6, 1e9, 1e-3
    assert predict("ring", S, 4, a, B) == pytest.approx(6 * (a + S / 4 / B))
    assert predict("halving-doubling", S, 4, a, B) == pytest.approx(4 * a + 1.5 * S / B)
    assert predict("halving-doubling", S, 5, a, B) == pytest.approx(4 * a + 1.5 * S / B + 2 * (a + S / B))
    assert predict("tree", S, 5, a, B) == pytest.approx(6 * (a + S / B))
    assert predict("ring", S, 1, a, B) == 0.0


@pytest.mark.parametrize("nbytes,world,delay_s,bandwidth,expected", [
    (64 * 1024, 8, 0.005, None, "halving-doubling"),  # 5 ms a message: 6 steps against the ring's 14
    (64 << 20, 8, 0.0, None, "halving-doubling"),      # the ring's bytes in 6 steps, not 14
    (64 << 20, 6, 0.0, None, "ring"),                  # 6 ranks: halving-doubling's fold moves whole tensors
    (1024, 5, 0.005, None, "halving-doubling"),        # 5 ms a message: its fold costs 2 steps, the ring 8
    (64 << 20, 3, 0.0, 12.5e6, "ring"),                # 100mbit, 3 ranks: whole-tensor steps are the worst
])
def test_auto_picks_the_fastest_by_the_model(nbytes, world, delay_s, bandwidth, expected):
    assert choose(nbytes, world, delay_s, bandwidth) == expected
    alpha = MESSAGE_S + delay_s
    b = bandwidth or 1.2e9
    best = min(predict(a, nbytes, world, alpha, b) for a in ("ring", "halving-doubling", "tree"))
    assert predict(expected, nbytes, world, alpha, b) == best


def test_the_unpipelined_tree_never_beats_halving_doubling_in_this_model():
    """Both take 2 log2 steps; the tree moves the whole tensor in each (it wins only pipelined,
    as NCCL's is), so auto never picks it."""
    for world in range(2, 17):
        for nbytes in (1024, 1 << 20, 64 << 20):
            assert choose(nbytes, world, 0.005) != "tree" and choose(nbytes, world) != "tree"


def test_two_ranks_tie_and_take_the_ring():
    assert choose(4 << 20, 2) == "ring"  # every algorithm is one exchange each way on 2 ranks
