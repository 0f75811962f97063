"""The hierarchical all-reduce's and the ring's plans, run without processes (the simulator of
test_halving.py): every rank ends with the sum for racks even and uneven, and what crosses
the racks; and the plan-read cost model (allreduce/plancost.py) against the closed forms."""

from __future__ import annotations

import pytest
import torch

from allreduce import hierarchical, ringplan
from allreduce.auto import candidates, choose, predict
from allreduce.plancost import Links, rounds, seconds

from plans import LENGTHS, simulate

LAYOUTS = [(0, 0), (0, 1), (0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 1, 1), (0, 1, 1), (0, 0, 0, 0),
           (0, 1, 2, 0, 1, 2), (2, 2, 0, 1, 0, 1, 1), (0, 1, 0, 1, 0, 1, 0, 1)]


@pytest.mark.parametrize("racks", LAYOUTS)
def test_every_rank_ends_with_the_sum(racks):
    world = len(racks)
    for numel in LENGTHS:
        values = [torch.randn(numel, generator=torch.Generator().manual_seed(7 * r + numel), dtype=torch.float64)
                  for r in range(world)]
        expected = sum(values)
        for flat in simulate(values, hierarchical.plan_for(racks)):
            torch.testing.assert_close(flat, expected, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_the_ring_plan_sums_and_sends_what_the_ring_sends(world):
    values = [torch.randn(101, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(world)]
    for flat in simulate(values, ringplan.plan):
        torch.testing.assert_close(flat, sum(values), rtol=1e-14, atol=1e-14)
    assert len(ringplan.plan(800, 0, world)) == 2 * (world - 1)


def crossing(plan, racks: tuple[int, ...], numel: int) -> int:
    """Elements that cross between racks, over the whole all-reduce."""
    plans = [plan(numel, r, len(racks)) for r in range(len(racks))]
    return sum(m.send[1] - m.send[0] for moves in rounds(plans) for i, j, m, _ in moves if racks[i] != racks[j])


def test_only_2_r_minus_1_over_r_of_the_tensor_crosses_each_uplink():
    racks, numel = (0, 1, 0, 1, 0, 1, 0, 1), 8000  # 2 racks of 4, placed round-robin
    assert crossing(hierarchical.plan_for(racks), racks, numel) == 2 * 2 * (2 - 1) // 2 * numel  # both ways
    # the ring in rank order crosses at every hop: each of 8 ranks sends 2(N-1)/N of it across
    assert crossing(ringplan.plan, racks, numel) == 8 * 2 * 7 * numel // 8


def test_a_folded_rank_moves_the_whole_tensor_to_its_rack_partner():
    plan = hierarchical.plan_for((0, 0, 0, 1, 1))  # rack 0 has one rank more: rank 2 folds into rank 0
    assert [(s.peer, s.send, s.recv) for s in plan(10, 2, 5)] == [(0, (0, 10), (0, 0)), (0, (0, 0), (0, 10))]


def test_the_plan_model_gives_the_closed_forms_on_one_piece():
    S, B, a = 8e6, 1e9, 1e-3
    assert predict("ring", S, 4, a, B) == pytest.approx(6 * (a + S / 4 / B))
    assert predict("tree", S, 5, a, B) == pytest.approx(6 * (a + S / B))
    # pipelined in 4 pieces, the ring's links are as busy (its bytes do not shrink); the tree's
    # rounds overlap, but its root still takes 3 whole tensors in and sends 3 out
    assert predict("ring", S, 4, a, B, npieces=4) == pytest.approx(6 * a + 6 * S / 4 / B)
    assert 6 * a + 3 * S / B < predict("tree", S, 5, a, B, npieces=4) < 6 * (a + S / B)


def test_on_two_racks_behind_a_4_to_1_uplink_hierarchical_takes_half_the_rings_time():
    S, B = 16e6, 25e6
    racks = (0, 1, 0, 1)  # 2 hosts a rack at B behind an uplink of 2B/4
    ring = predict("ring", S, 4, 0.0, B, racks, B / 2)
    hier = predict("hierarchical", S, 4, 0.0, B, racks, B / 2)
    assert ring == pytest.approx(6 * S / B)  # every hop: 2 hosts' S/4 through B/2
    assert hier == pytest.approx(S / 2 / B + 2 * S / B + S / 2 / B)
    # halving-doubling's first and last steps pair 0-2 and 1-3, inside the racks: as good here
    assert predict("halving-doubling", S, 4, 0.0, B, racks, B / 2) == pytest.approx(hier)
    assert choose(S, 4, 0.0, B, racks, B / 2) in ("hierarchical", "halving-doubling")
    assert choose(S, 6, 0.0, B, (0, 1, 0, 1, 0, 1), B / 2) == "hierarchical"
    assert "hierarchical" not in candidates(None) + candidates((0, 0, 0, 0))  # one rack: a flat ring
    assert predict("ring", S, 4, 0.0, B, racks, None) == pytest.approx(predict("ring", S, 4, 0.0, B))


def test_pieces_pipeline_as_one_pieces_rounds_then_the_busiest_links_share_of_each_other_piece():
    S, B = 16e6, 25e6
    racks, s = (0, 1, 0, 1), S / 4  # 4 pieces of s
    # The tree on two racks: its rounds take 4s/B (1->0 and 3->2 across one uplink of B/2),
    # s/B, s/B (2<->0 in rack 0) and 4s/B (0->1 and 2->3 back across the other uplink's
    # direction); each uplink direction carries 2s of every piece. A fast round in a rack no
    # longer waits on a slow one across the uplink: 10 s/B + 3 x 4 s/B, not 7 x 4 s/B.
    assert predict("tree", S, 4, 0.0, B, racks, B / 2, npieces=4) == pytest.approx(22 * s / B)
    # the ring's pieces keep every link busy: no fill beyond its bytes, however many pieces
    for n in (1, 2, 4):
        assert predict("ring", S, 4, 0.0, B, npieces=n) == pytest.approx(6 * S / 4 / B)


def test_a_plan_that_cannot_finish_is_named():
    from allreduce.steps import Step
    with pytest.raises(ValueError, match="deadlock"):
        seconds([[Step(1, (0, 0), (0, 4), True)], [Step(0, (0, 0), (0, 4), True)]], Links(1.0), 0.0)


def test_a_links_burst_lets_small_messages_through_and_barely_shortens_large_ones():
    B = 125e6
    # 4 ranks, 4 KB: each round's bytes fit the 4 ms burst, so only the messages' costs remain
    assert predict("tree", 4096, 4, 0.0, B, per_message=1e-3, burst_s=0.004) == pytest.approx(4 * 1e-3)
    # 64 MB on the ring: the burst is 0.5 MB of 96 MB a link carries
    big, bursting = predict("ring", 64 << 20, 4, 0.0, B, npieces=4), \
        predict("ring", 64 << 20, 4, 0.0, B, npieces=4, burst_s=0.004)
    assert 0.99 * big < bursting < big
    # on two racks at 4:1, 32 KB: the tree's hops fit the uplinks' bursts (1 ms of 500mbit: 62.5
    # KB), its link rounds do not; at 256 KB halving-doubling's rounds are the shorter
    racks = (0, 1, 0, 1)
    assert choose(32 << 10, 4, 0.0, B, racks, B / 2, crowded=2.0) == "tree"
    assert choose(256 << 10, 4, 0.0, B, racks, B / 2, crowded=2.0) == "halving-doubling"
