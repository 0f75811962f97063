"""The link model's bytes per host, case by case (M = 1, so the figures are fractions of M)."""

import pytest

from analysis.linkmodel import host_bytes, link_time


@pytest.mark.parametrize("label,n,s,placement,expected", [
    ("allreduce", 2, 1, "colocated", {"w0": 1.0, "w1": 1.0}),
    ("allreduce/ring", 4, 1, "colocated", {f"w{i}": 1.5 for i in range(4)}),
    ("ddp", 1, 1, "colocated", {"w0": 0.0}),
    ("local", 2, 1, "colocated", {"w0": 0.0, "w1": 0.0}),
    ("ps-sync", 2, 1, "separate", {"w0": 1.0, "w1": 1.0, "s0": 2.0}),
    ("ps-sync", 4, 2, "separate", {"w0": 1.0, "w1": 1.0, "w2": 1.0, "w3": 1.0, "s0": 2.0, "s1": 2.0}),
    ("ps-async", 4, 4, "colocated", {f"w{i}": 1.5 for i in range(4)}),  # the ring's
    ("ps-sync", 4, 1, "colocated", {"w0": 3.0, "w1": 1.0, "w2": 1.0, "w3": 1.0}),
    ("ps-sync", 2, 2, "colocated", {"w0": 1.0, "w1": 1.0}),
    ("ps-sync", 1, 1, "colocated", {"w0": 0.0}),
])
def test_bytes_each_host_carries(label, n, s, placement, expected):
    got = host_bytes(label, n, s, 1.0, placement)
    assert {h: out for h, (out, _) in got.items()} == pytest.approx(expected)
    assert all(out == inn for out, inn in got.values())  # every case here is symmetric


def test_link_time_is_the_busiest_host_at_the_rate():
    # 80.15 MB through a 200 Mbit/s link once each way: the interface's 3.2 s.
    assert link_time("allreduce", 2, 1, 80.15e6, 200e6) == pytest.approx(3.206)
    assert link_time("ps-sync", 4, 1, 80.15e6, 200e6, "separate") == pytest.approx(2 * link_time(
        "ps-sync", 2, 1, 80.15e6, 200e6, "separate"))
    with pytest.raises(ValueError, match="placement"):
        link_time("ps-sync", 2, 1, 1.0, 1.0, "sideways")
