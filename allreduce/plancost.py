"""What an all-reduce's plans cost on a network: the alpha-beta model of allreduce.algorithm=auto
and of the cost model's two-tier rows, read off the plans themselves (allreduce/steps.py),
so a new algorithm is priced as it runs.

`rounds(plans)` plays every rank's plan with rendezvous messages (a step's send completes
only when its peer's current step receives it): each round is the set of messages that can
cross at once; a plan that cannot finish raises. A round costs alpha (the links' latency),
the fixed cost of each message its busiest rank sends or receives (per_message), and its
busiest link's bytes over that link's bandwidth (less what the link's burst lets through at
once where it has had time to refill: Links.burst_s), where a
message loads its sender's link out, its receiver's link in and, between racks, the uplinks
of both racks (Links). A tensor cut into P pieces runs the plan once per piece, pipelined as
a perfect schedule would: one piece's rounds end to end (the pipeline's fill), then P-1 more
times the busiest link's share of a piece over all rounds (its bottleneck), each link
carrying both directions at once. Rounds a piece behind one another, each as long as its
busiest link with every piece then in flight (the model before), priced a tree on two racks
at 980 ms for 16 MB where it ran in 793: a fast round in a rack waited on a slow one across
the uplink.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .steps import Step


@dataclass(frozen=True)
class Links:
    """A network the model prices: each host's link (bytes/s each way), and with racks the rack
    of every rank and each rack's uplink to the core (bytes/s each way; None: no bottleneck)."""

    host: float
    racks: tuple[int, ...] | None = None
    uplink: float | None = None
    burst_s: float = 0.0
    """Seconds of its rate a link lets through at once after an idle spell (a token bucket's
    burst: the emulated links' tbf and htb hold 1 ms, auto.EMULATED_BURST_S; a real NIC or switch
    port none)."""
    burst_min: float = 0.0
    """... and at least this many bytes, where it has a burst (auto.EMULATED_BURST_MIN_BYTES)."""

    def burst(self, bandwidth: float) -> float:
        """Bytes a link of `bandwidth` bytes/s lets through at once after an idle spell."""
        return max(bandwidth * self.burst_s, self.burst_min) if self.burst_s > 0 else 0.0

    def loads(self, src: int, dst: int) -> list[tuple[tuple, float]]:
        """The links a message from src to dst crosses, with each one's bandwidth."""
        out = [(("out", src), self.host), (("in", dst), self.host)]
        if self.racks is not None and self.uplink and self.racks[src] != self.racks[dst]:
            out += [(("up", self.racks[src]), self.uplink), (("down", self.racks[dst]), self.uplink)]
        return out


Transfer = tuple[int, int, Step, Step]
"""One message: (sender, receiver, the sender's step, the receiver's step)."""


def rounds(plans: list[list[Step]]) -> list[list[Transfer]]:
    """The messages of every rank's plan (plans[r]) grouped into rounds (see the module)."""
    world = len(plans)
    at, sent, got = [0] * world, [False] * world, [False] * world
    out: list[list[Transfer]] = []

    def settle() -> None:  # finish steps that have nothing left to move
        for r in range(world):
            while at[r] < len(plans[r]):
                st = plans[r][at[r]]
                if (sent[r] or st.send[1] <= st.send[0]) and (got[r] or st.recv[1] <= st.recv[0]):
                    at[r], sent[r], got[r] = at[r] + 1, False, False
                else:
                    break

    settle()
    while any(at[r] < len(plans[r]) for r in range(world)):
        moving = []
        for i in range(world):
            if at[i] == len(plans[i]) or sent[i] or plans[i][at[i]].send[1] <= plans[i][at[i]].send[0]:
                continue
            mine = plans[i][at[i]]
            j = mine.peer
            if at[j] < len(plans[j]) and not got[j]:
                theirs = plans[j][at[j]]
                if theirs.recv[1] > theirs.recv[0] and theirs.source == i:
                    if theirs.recv[1] - theirs.recv[0] != mine.send[1] - mine.send[0]:
                        raise ValueError(f"rank {i} sends {mine.send} to rank {j}, which receives {theirs.recv}")
                    moving.append((i, j, mine, theirs))
        if not moving:
            stuck = {r: plans[r][at[r]] for r in range(world) if at[r] < len(plans[r])}
            raise ValueError(f"the plans deadlock: {stuck}")
        for i, j, _, _ in moving:
            sent[i] = got[j] = True
        out.append(moving)
        settle()
    return out


def seconds(plans: list[list[Step]], links: Links, alpha: float, pieces: int = 1, itemsize: int = 1,
            per_message: float = 0.0) -> float:
    """The model's time for plans of one piece (elements of itemsize bytes), run as `pieces`
    pipelined pieces (see the module). alpha: each round's latency; per_message: what each
    message a rank sends or receives costs it (a round costs its busiest rank's count of them:
    an exchange two, a tree's hop one)."""
    loads, handled = [], []
    for moves in rounds(plans):
        load: dict[tuple, list[float]] = {}
        count: dict[int, int] = {}
        for i, j, mine, _ in moves:
            nbytes = (mine.send[1] - mine.send[0]) * itemsize
            for link, bw in links.loads(i, j):
                load.setdefault(link, [0.0, bw])[0] += nbytes
            count[i], count[j] = count.get(i, 0) + 1, count.get(j, 0) + 1
        loads.append(load)
        handled.append(max(count.values()))
    total = len(loads) * alpha + per_message * sum(handled)
    tokens: dict[tuple, tuple[float, float]] = {}  # a link's burst left, and when it was counted
    clock = 0.0
    per_piece: dict[tuple, list[float]] = {}  # each link's bytes of one piece, over all rounds
    for load in loads:  # one piece's rounds, end to end
        for link, (nbytes, bw) in load.items():
            per_piece.setdefault(link, [0.0, bw])[0] += nbytes
        ready = {}  # each link's burst at the round's start, refilled while it waited
        for link, (_, bw) in load.items():
            left, since = tokens.get(link, (links.burst(bw), clock))
            ready[link] = min(links.burst(bw), left + bw * (clock - since))
        took = max((max(0.0, nbytes - ready[link]) / bw for link, (nbytes, bw) in load.items()), default=0.0)
        for link, (nbytes, bw) in load.items():
            tokens[link] = (max(0.0, min(links.burst(bw), ready[link] + bw * took) - nbytes), clock + took)
        clock += took
    bottleneck = max((nbytes / bw for nbytes, bw in per_piece.values()), default=0.0)
    return total + clock + (pieces - 1) * bottleneck


@lru_cache(maxsize=4096)
def predict_plan(plan, piece_bytes: int, world: int, links: Links, alpha: float, pieces: int,
                 per_message: float = 0.0) -> float:
    """seconds() of the algorithm given by plan(numel, rank, world), for pieces of piece_bytes."""
    return seconds([plan(piece_bytes, r, world) for r in range(world)], links, alpha, pieces, 1, per_message)
