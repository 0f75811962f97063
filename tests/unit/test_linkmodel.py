"""The link model's bytes per host and phase, case by case (M = 1: fractions of M); the
algorithm's ideal from them, and the model of psar's own exchange beside it."""

import pytest

from analysis.linkmodel import PAYLOAD, link_time, overlapped, phases, psar_link_time


def _busiest(label, n, s, placement):
    return [max(max(o, i) for o, i in phase.values()) for phase in phases(label, n, s, 1.0, placement)]


@pytest.mark.parametrize("label,n,s,placement,expected", [
    ("allreduce", 2, 1, "colocated", [1.0]),
    ("allreduce/ring", 4, 1, "colocated", [1.5]),
    ("ddp", 1, 1, "colocated", [0.0]),
    ("local", 2, 1, "colocated", []),
    ("ps-sync", 2, 1, "separate", [2.0, 2.0]),      # the shard's link: N*M in, then N*M out
    ("ps-sync", 4, 1, "separate", [4.0, 4.0]),      # twice the 2-worker time
    ("ps-sync", 4, 2, "separate", [2.0, 2.0]),
    ("ps-sync", 4, 4, "separate", [1.0, 1.0]),      # the workers' own links bound it
    ("ps-async", 4, 4, "colocated", [0.75, 0.75]),  # the ring's 1.5 in all
    ("ps-sync", 4, 1, "colocated", [3.0, 3.0]),     # shard 0's host serves the 3 others
    ("ps-sync", 1, 1, "colocated", [0.0, 0.0]),
])
def test_busiest_link_of_each_phase(label, n, s, placement, expected):
    assert _busiest(label, n, s, placement) == pytest.approx(expected)


def test_pull_phase_mirrors_the_push_phase():
    push, pull = phases("ps-sync", 4, 2, 1.0, "separate")
    assert push["w0"] == (1.0, 0.0) and pull["w0"] == (0.0, 1.0)
    assert push["s1"] == (0.0, 2.0) and pull["s1"] == (2.0, 0.0)


def test_link_time_at_the_rate():
    # 80.15 MB through a 200 Mbit/s link once each way: the interface's 3.2 s, and the frames'
    # headers on top (1448 bytes of data in each 1514-byte frame).
    assert PAYLOAD == pytest.approx(0.9564, abs=1e-4)
    assert link_time("allreduce", 2, 1, 80.15e6, 200e6) == pytest.approx(3.206 / PAYLOAD)
    two, four = (link_time("ps-sync", n, 1, 80.15e6, 200e6, "separate") for n in (2, 4))
    assert four == pytest.approx(2 * two)
    with pytest.raises(ValueError, match="placement"):
        link_time("ps-sync", 2, 1, 1.0, 1.0, "sideways")


@pytest.mark.parametrize("label,n,s,placement,expected", [
    ("allreduce", 4, 1, "colocated", 1.5),          # 2(N-1)/N
    ("ps-sync", 2, 1, "separate", 2.0),             # the shard's link: N*M each way, at once
    ("ps-sync", 4, 2, "separate", 2.0),
    ("ps-sync", 4, 4, "separate", 1.0),             # BytePS: k = N spare shards, M/B
    ("ps-sync", 4, 8, "separate", 1.0),             # never below the workers' own links
    ("ps-async", 4, 4, "colocated", 1.5),           # co-located: as the ring
    ("ps-sync", 3, 3, "colocated", 4 / 3),
])
def test_the_ideal_is_full_duplex_and_finely_pipelined(label, n, s, placement, expected):
    assert link_time(label, n, s, 1.0, 8.0 / PAYLOAD, placement) == pytest.approx(expected)
    # psar's two-phase exchange is never faster than the ideal
    assert psar_link_time(label, n, s, 1.0, 8.0 / PAYLOAD, placement) >= expected - 1e-12


def test_overlap_of_pipelined_replies():
    # One message: nothing to overlap. Two halves: the first half's reply runs while the
    # second half is pushed. Many small ones: the pull hides behind the push but for the last.
    assert overlapped(1.0, 1.0, [1.0]) == pytest.approx(2.0)
    assert overlapped(1.0, 1.0, [0.5, 0.5]) == pytest.approx(1.5)
    assert overlapped(1.0, 1.0, [1] * 100) == pytest.approx(1.01)
    # mlp-mid's two messages (16.9 MB first, 6.4 MB second): the second reply waits for the first.
    assert overlapped(1.0, 1.0, [16.9, 6.4]) == pytest.approx(2 * 16.9 / 23.3 + 6.4 / 23.3)
    assert overlapped(1.0, 1.0, [6.4, 16.9]) == pytest.approx(1 + 16.9 / 23.3)
    with pytest.raises(ValueError, match="fractions"):
        overlapped(1.0, 1.0, [])


def test_messages_overlap_only_separate_ps_sync():
    two_phase = psar_link_time("ps-sync", 4, 1, 1e6, 1e6, "separate")
    assert two_phase == pytest.approx(2 * link_time("ps-sync", 4, 1, 1e6, 1e6, "separate"))
    assert psar_link_time("ps-sync", 4, 1, 1e6, 1e6, "separate", [0.5, 0.5]) == pytest.approx(0.75 * two_phase)
    # Co-located, replies share the links with the pushes; async pulls once all is pushed.
    assert psar_link_time("ps-sync", 4, 4, 1e6, 1e6, "colocated", [0.5, 0.5]) == \
        pytest.approx(psar_link_time("ps-sync", 4, 4, 1e6, 1e6, "colocated"))
    assert psar_link_time("ps-async", 4, 1, 1e6, 1e6, "separate", [0.5, 0.5]) == pytest.approx(two_phase)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zero_sends_an_all_reduce_and_stage_three_half_as_much_again(n):
    """ZeRO's reduce-scatter and all-gather are the ring all-reduce's two halves, 2(N-1)/N M;
    stage 3 gathers twice, 3(N-1)/N M (Rajbhandari et al.'s 2 and 3 Psi)."""
    ring = link_time("allreduce/library", n, 1, 1e6, 200e6)
    assert link_time("zero-1", n, 1, 1e6, 200e6) == pytest.approx(ring)
    assert link_time("zero-2", n, 1, 1e6, 200e6) == pytest.approx(ring)
    assert link_time("zero-3", n, 1, 1e6, 200e6) == pytest.approx(1.5 * ring)
    assert psar_link_time("zero-3", n, 1, 1e6, 200e6) == pytest.approx(1.5 * ring)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_gossip_sends_its_model_to_each_out_neighbour(n):
    """D-PSGD on a ring: 2M each way (M at N=2, one neighbour); one-peer exponential M; the
    complete graph (N-1)M; the exponential graph one model per distinct offset +- 2^k."""
    one = link_time("gossip/one-peer-exponential", n, 1, 1e6, 200e6)
    assert one == pytest.approx(1e6 * 8 / (200e6 * PAYLOAD))
    assert link_time("gossip/ring", n, 1, 1e6, 200e6) == pytest.approx(min(2, n - 1) * one)
    assert link_time("gossip/complete", n, 1, 1e6, 200e6) == pytest.approx((n - 1) * one)
    assert link_time("gossip/exponential", n, 1, 1e6, 200e6) == pytest.approx({2: 1, 4: 3, 8: 5}[n] * one)
