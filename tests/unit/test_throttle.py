"""ps.throttle: what a peer can cause by the thousand is logged once per interval and kind,
with a count of what was left out; a shard's transport and dispatcher log through it."""

from __future__ import annotations

import logging

import torch

from ps.throttle import MAX_KINDS, Throttle
from ps.transport import ServerTransport


def test_one_line_per_kind_and_interval_then_the_count_left_out(caplog):
    now = [0.0]
    throttle = Throttle(logging.getLogger("psar.test.throttle"), 5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, "psar.test.throttle"):
        for i in range(20_000):  # 20,000 in 10 s of one kind, then one of another
            now[0] = i * 0.0005
            throttle.log(logging.WARNING, "gone", "peer %d gone", i)
        throttle.log(logging.INFO, "other", "something else")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["peer 0 gone", "peer 10000 gone (and 9999 more like it in the last 5 s)", "something else"]


def test_it_remembers_a_bounded_number_of_kinds():
    throttle = Throttle(logging.getLogger("psar.test.throttle"), 5.0, clock=lambda: 0.0)
    for kind in range(3 * MAX_KINDS):
        throttle.log(logging.DEBUG, kind, "x")
    assert len(throttle._kinds) == MAX_KINDS


def test_a_shards_replies_to_gone_peers_write_a_few_lines(caplog):
    """20,000 replies to a peer that is not connected (ROUTER_MANDATORY refuses each): the
    transport's log gets one line, not 20,000."""
    transport = ServerTransport("inproc://psar-throttle-test")
    frame = memoryview(torch.zeros(4).numpy()).cast("B")
    try:
        with caplog.at_level(logging.WARNING, "psar.ps.transport"):
            sent = [transport.send(b"\x00gone", [b"header", frame]) for _ in range(20_000)]
    finally:
        transport.close()
    assert not any(sent)
    lines = [r for r in caplog.records if "could not send" in r.getMessage()]
    assert 1 <= len(lines) <= 3, len(lines)
