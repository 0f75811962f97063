"""Max-min fair sharing of links among flows (analysis/fairshare.py), against hand-worked
cases, and fast enough for a step of 1024 workers."""

from __future__ import annotations

import pytest

from analysis.fairshare import Flow, fair_rates, priority_rates, simulate


def test_one_flow_takes_its_bytes_over_the_link_and_its_latency():
    assert simulate([Flow("a", ("l",), 100, latency=0.5)], {"l": 50}) == {"a": pytest.approx(2.5)}


def test_two_flows_on_one_link_share_it_and_a_flow_on_no_link_arrives_at_once():
    arrived = simulate([Flow("a", ("l",), 100), Flow("b", ("l",), 100), Flow("local", (), 10, start=1)], {"l": 100})
    assert arrived == {"a": pytest.approx(2.0), "b": pytest.approx(2.0), "local": pytest.approx(1.0)}


def test_a_flow_held_back_elsewhere_leaves_the_shared_link_to_the_other():
    """A: 10 bytes/s shared by f1 and f2; B: 4 bytes/s, f1 only. Max-min: f1 4, f2 6; once f2
    is done (6 bytes, 1 s) f1 stays at B's 4 and ends its 8 bytes at 2 s."""
    assert fair_rates([Flow("f1", ("A", "B"), 8), Flow("f2", ("A",), 6)], {"A": 10, "B": 4}) == {"f1": 4, "f2": 6}
    assert simulate([Flow("f1", ("A", "B"), 8), Flow("f2", ("A",), 6)], {"A": 10, "B": 4}) == \
        {"f1": pytest.approx(2.0), "f2": pytest.approx(1.0)}


def test_a_late_flow_shares_what_is_left():
    """a alone for 1 s (10 of its 30 bytes), then both at 5: a's 20 left end at 5 s, b's 10 at
    3 s, after which a has 10 bytes/s again: a ends at 4 s."""
    arrived = simulate([Flow("a", ("l",), 30), Flow("b", ("l",), 10, start=1)], {"l": 10})
    assert arrived == {"a": pytest.approx(4.0), "b": pytest.approx(3.0)}


def test_an_uplink_shared_by_a_rack_binds_below_the_hosts_links():
    """Two hosts of a rack send 100 bytes each across a 50 bytes/s uplink; their own links
    carry 100 bytes/s: the uplink halves to 25 each, 4 s."""
    capacity = {"out0": 100, "out1": 100, "up0": 50, "in2": 100, "in3": 100}
    arrived = simulate([Flow("0-2", ("out0", "up0", "in2"), 100), Flow("1-3", ("out1", "up0", "in3"), 100)], capacity)
    assert arrived == {"0-2": pytest.approx(4.0), "1-3": pytest.approx(4.0)}


def test_bad_flows_are_refused_by_name():
    with pytest.raises(ValueError, match="no capacity given: x"):
        simulate([Flow("a", ("x",), 1)], {})
    with pytest.raises(ValueError, match="must be >= 0"):
        Flow("a", ("l",), -1)
    with pytest.raises(ValueError, match="unique"):
        simulate([Flow("a", ("l",), 1), Flow("a", ("l",), 1)], {"l": 1})


def test_a_ring_hop_of_1024_workers_moves_every_flow_at_the_link_rate():
    """1024 flows, each host's out to the next host's in, all at once."""
    n = 1024
    capacity = {f"out{i}": 1e9 for i in range(n)} | {f"in{i}": 1e9 for i in range(n)}
    arrived = simulate([Flow(f"{i}", (f"out{i}", f"in{(i + 1) % n}"), 1e6) for i in range(n)], capacity)
    assert len(arrived) == n and all(t == pytest.approx(1e-3) for t in arrived.values())


def test_a_class_of_flows_moves_as_its_flows_do_one_by_one():
    """Four workers push 100 bytes to one shard at once: the shard's way in (100 bytes/s)
    gives each 25. As one class: a fan of 1 on a worker's way out, 4 on the shard's way in."""
    capacity = {f"out{i}": 100 for i in range(4)} | {"in:s": 100}
    one_by_one = simulate([Flow(f"{i}", (f"out{i}", "in:s"), 100) for i in range(4)], capacity)
    as_class = simulate([Flow("w", ("out:w", "in:s"), 100, fan=(1, 4))], {"out:w": 100, "in:s": 100})
    assert as_class == {"w": pytest.approx(4.0)} and list(one_by_one.values()) == [pytest.approx(4.0)] * 4
    with pytest.raises(ValueError, match="one count > 0 per link"):
        Flow("w", ("out:w", "in:s"), 100, fan=(1,))


def test_an_arrival_starts_the_flows_that_wait_for_it():
    """A push of 100 bytes at 100 bytes/s with 0.5 s of latency arrives at 1.5 s; the reply
    it starts (50 bytes at 50) at 2.5 s; the next push on the same connection leaves with the
    first's last byte, at 1 s, and arrives at 2 s."""
    def then(name, at):
        if name != "push":
            return []
        return [Flow("reply", ("back",), 50, start=at), Flow("push2", ("out",), 100, start=at - 0.5)]

    arrived = simulate([Flow("push", ("out",), 100, latency=0.5)], {"out": 100, "back": 50}, then)
    assert arrived == {"push": pytest.approx(1.5), "reply": pytest.approx(2.5), "push2": pytest.approx(2.0)}
    with pytest.raises(ValueError, match="last byte"):
        simulate([Flow("a", ("out",), 100)], {"out": 100}, lambda name, at: [Flow("b", ("out",), 1, start=0.0)])


def test_first_come_first_served_links_give_the_earlier_flow_what_it_can_take():
    """Served by priority, a flow takes what its links have left and the next ones the rest:
    the first of two into one link has it all and ends first; one held back by a slower link
    elsewhere leaves the rest to the next (a host's queue, first in first out)."""
    one = {"out": 10.0, "slow": 4.0, "fast": 100.0}
    first, second = Flow("a", ("out", "fast"), 10.0, priority=0), Flow("b", ("out", "fast"), 10.0, priority=1)
    assert priority_rates([second, first], one) == {"a": 10.0, "b": 0.0}
    assert simulate([first, second], one, share=priority_rates) == pytest.approx({"a": 1.0, "b": 2.0})
    assert simulate([first, second], one) == pytest.approx({"a": 2.0, "b": 2.0})  # fair: together
    held = Flow("a", ("out", "slow"), 8.0, priority=0)
    assert priority_rates([held, second], one) == {"a": 4.0, "b": 6.0}
    # a class of three alike flows takes three times its rate from the links it shares
    many = Flow("c", ("out", "fast"), 1.0, fan=(3.0, 1.0), priority=0)
    assert priority_rates([many, second], one) == pytest.approx({"c": 10.0 / 3, "b": 0.0})
