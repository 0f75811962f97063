"""The shard's serve loop (ps.shard.dispatch.serve) around a fake shard and transport: every
request answered at once and in order, and the periodic work (tick) run at most every
TICK_S while requests stream in, and whenever the socket is idle."""

from __future__ import annotations

from ps.config import PSConfig
from ps.shard.dispatch import TICK_S, serve


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeShard:
    def __init__(self, clock: Clock, reply_delay_s: float = 0.0) -> None:
        self.config, self.clock, self.reply_delay_s = PSConfig(), clock, reply_delay_s
        self.ticks: list[float] = []
        self.stopped = self.finished = False
        self.aborted = None
        self.waiting: list = []

    def handle(self, peer, frames):
        return [(peer, [b"re:" + frames[0]])]

    def tick(self):
        self.ticks.append(self.clock())
        return []

    def stats(self):
        return {}


class FakeTransport:
    """Delivers `count` requests `gap_s` apart (the clock moves on each), then idles once and
    has the shard stop."""

    def __init__(self, shard: FakeShard, count: int, gap_s: float) -> None:
        self.shard, self.left, self.gap_s, self.sent = shard, count, gap_s, []
        self.idle = 0

    def recv(self, timeout_s):
        if self.left:
            self.left -= 1
            self.shard.clock.now += self.gap_s
            return b"w0", [str(self.left).encode()]
        self.idle += 1
        self.shard.clock.now += timeout_s
        if self.idle == 3:
            self.shard.stopped = True
        return None

    def send(self, peer, frames):
        self.sent.append((self.shard.clock.now, frames[0]))


def test_requests_are_answered_at_once_and_ticks_are_rate_limited():
    shard = FakeShard(Clock())
    transport = FakeTransport(shard, count=200, gap_s=0.001)  # 200 ms of requests, 1 ms apart
    assert serve(shard, transport) == "shutdown"
    assert [f for _, f in transport.sent] == [b"re:" + str(i).encode() for i in reversed(range(200))]
    busy = [t for t in shard.ticks if t <= 0.2 + 1e-9]
    assert 0.2 / TICK_S - 2 <= len(busy) <= 0.2 / TICK_S + 2  # about one per TICK_S, not 200
    assert all(b - a >= TICK_S - 1e-9 for a, b in zip(busy, busy[1:]))
    assert len(shard.ticks) - len(busy) == 3  # every idle wake ticks


def test_replies_wait_out_an_injected_delay():
    shard = FakeShard(Clock(), reply_delay_s=0.05)
    transport = FakeTransport(shard, count=3, gap_s=0.001)
    assert serve(shard, transport) == "shutdown"
    assert len(transport.sent) == 3
    assert all(sent_at >= 0.05 for sent_at, _ in transport.sent)
