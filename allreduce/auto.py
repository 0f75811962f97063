"""allreduce.algorithm=auto: for each bucket, the algorithm the alpha-beta model predicts
fastest for its size on the run's links, as NCCL picks ring or tree per message size.

The model (allreduce/plancost.py) reads each algorithm's plans: a round of messages costs
alpha (the run's per-message delay, net.latency_ms or fault.delay_ms), MESSAGE_S (loopback)
or LINK_MESSAGE_S (emulated links) for each message its busiest rank sends or receives (times
the ranks per core where they share a machine's cores), and its busiest link's bytes over
that link's bandwidth
(net.rate, or LOOPBACK_BYTES_S without an emulated network; with racks, net.uplink for what
crosses them); a tensor in P pieces takes one piece's rounds, then P-1 times the busiest
link's share of a piece. On one flat network and in one piece, for S bytes on N ranks, that
is:

    ring               2(N-1) (alpha + S/N / B)
    halving-doubling   2 log2(p) alpha + 2(p-1)/p S / B, + 2 (alpha + S / B) where N is not
                       a power of two p (the folded ranks' whole tensors, there and back)
    tree               2 ceil(log2 N) (alpha + S / B)

and `hierarchical` joins them where the ranks are in more than one rack (or host).
Every rank computes the same choice from the same numbers: no message is needed to agree.
"""

from __future__ import annotations

import os
from functools import lru_cache

from . import halving, hierarchical, ringplan, tree
from .plancost import Links, predict_plan
from .ring import MAX_PIECES, piece_count

MESSAGE_S = 1e-4
"""A message's fixed cost to a rank that sends or receives it, on loopback Gloo with a core
per rank: a 1 KiB exchange between 2 ranks (a message each way) took 186 us."""
LINK_MESSAGE_S = 2.5e-4
"""The same over an emulated host's link (a veth, htb and tbf each way, --net RATE): on 2
cores at 1gbit, 4 KB took 5.65 ms on the ring (4 ranks, 6 exchanges), 4.96 on halving-doubling
(4 exchanges) and 1.85 on the tree (4 one-way hops): 0.46 to 0.62 ms a message with 2 ranks a
core (0.55 to 0.68 before each receive was posted a step ahead). Ranks that share cores pay
it `crowding` times."""
EMULATED_BURST_S = 0.001
"""What an emulated link lets through at once after an idle spell, in seconds of its rate
(experiments/runtime/netns.py's BURST_S: tbf and htb need one): a message below it crosses
faster than the rate there. With the 4 ms the links once held, on two racks at 1gbit a 64 KB
tree took 2.2 ms where its rounds at the rate take 5.5."""
EMULATED_BURST_MIN_BYTES = 16_000
"""... and at least a few frames (netns.py's BURST_MIN_BYTES)."""
LOOPBACK_BYTES_S = 1.2e9
"""A link's bandwidth without an emulated network: psar bench's busbw on 2 ranks, 1.15 to 1.3
GB/s from 4 MiB on this 2-core machine."""
ALGORITHMS = ("ring", "halving-doubling", "tree")
_PLANS = {"ring": ringplan.plan, "halving-doubling": halving.plan, "tree": tree.plan}


def plan_of(algorithm: str, racks: tuple[int, ...]):
    """The plan(numel, rank, world) of one of our algorithms (hierarchical's over `racks`)."""
    if algorithm == "hierarchical":
        return hierarchical.plan_for(racks)
    if algorithm not in _PLANS:
        raise ValueError(f"no model of algorithm {algorithm!r}")
    return _PLANS[algorithm]


LINK_PIECES = 64
"""At most this many pieces for the algorithms of plans (tree, halving-doubling, hierarchical)
on emulated links, so pieces of PIECE_BYTES (1 MiB) up to 64 MiB; the ring, and every
algorithm on loopback: ring.MAX_PIECES. Where a plan's phases load different links (the
tree's 2 log2 N hops of the whole tensor, the racks' phases of the others), a piece must
cross all of them before the pipeline is full, and the last one crosses them alone: both
shrink with the piece. At 1gbit on 4 ranks, 4 pieces against 1 MiB ones: the tree's 16 MB
383 ms and 281 (the model: 329 and 278), 64 MB 1525 and 1234 in 16 pieces (1332 and
1132), 64 MiB 1308 in 16 and 1156 in 64 (1187 and 1134); on two racks 4:1, 16 MiB, the
tree 660 and 561, hierarchical 325 and 289 (312 and 284), halving-doubling 336 and 292;
flat halving-doubling 209 and 211, and the ring, whose every link is busy at every hop,
843 and 844 at 64 MiB. On loopback, where 4 ranks share
2 cores, more pieces cost more: the tree's 16 MB took 59 ms in 4 and 67 in 16, 64 MB 190
and 222."""
PIECES_CROWDING = 2.0
"""LINK_PIECES for halving-doubling and hierarchical only where ranks share this machine's
cores at most this many to one (crowding): beyond, a piece's messages and sums cost their
ranks more CPU than the pipeline saves. On 8 ranks in two racks at 1gbit (4 a core),
halving-doubling's 16 MiB took 287 ms in 4 pieces, 295 in 8 and 315 in 16, where the model
gives 276, 261 and 254; hierarchical's 349 and 348. The tree, whose whole tensor fills a
pipeline of 2 log2 N hops, gains there still: 1094 ms in 4 pieces, 684 in 16 (two sweeps)."""


def most_pieces(algorithm: str, emulated: bool, crowded: float = 1.0) -> int:
    """At most how many pipelined pieces `algorithm` cuts a tensor into (emulated: on emulated
    links, whose rate is far below what the CPU moves; crowded: crowding())."""
    if not emulated or algorithm == "ring" or (algorithm != "tree" and crowded > PIECES_CROWDING):
        return MAX_PIECES
    return LINK_PIECES


def pieces(nbytes: float, algorithm: str = "ring", emulated: bool = False, crowded: float = 1.0) -> int:
    """How many pipelined pieces a tensor of nbytes runs as on the CPU (allreduce/steps.py)."""
    return piece_count(int(nbytes), most=most_pieces(algorithm, emulated, crowded))


def predict(algorithm: str, nbytes: float, world: int, alpha: float, bandwidth: float,
            racks: tuple[int, ...] | None = None, uplink: float | None = None, npieces: int = 1,
            per_message: float = 0.0, burst_s: float = 0.0) -> float:
    """The model's seconds for one all-reduce of nbytes on `world` ranks, in npieces pieces;
    alpha: a round's latency, per_message: a message's cost to each rank that sends or
    receives it; racks: the rack of each rank, uplink: their uplinks' bytes/s; burst_s: the
    links' burst (plancost.Links), at least EMULATED_BURST_MIN_BYTES where there is one."""
    if world == 1:
        return 0.0
    plan = plan_of(algorithm, racks or (0,) * world)
    links = Links(bandwidth, racks, uplink, burst_s, EMULATED_BURST_MIN_BYTES)
    return predict_plan(plan, max(1, int(nbytes // npieces)), world, links, alpha, npieces, per_message)


def candidates(racks: tuple[int, ...] | None) -> tuple[str, ...]:
    """What auto chooses from: hierarchical too where the ranks are in more than one rack."""
    return ALGORITHMS + (("hierarchical",) if racks is not None and len(set(racks)) > 1 else ())


def crowding(local_ranks: int, cores: int | None = None) -> float:
    """How many ranks share each of this machine's cores (at least 1): what a message costs a
    rank, in MESSAGE_S, when local_ranks of the job's ranks run here (the whole job on
    loopback or an emulated network; under `psar launch`, this host's share)."""
    return max(1.0, local_ranks / max(1, cores or os.cpu_count() or 1))


@lru_cache(maxsize=1024)  # asked for every bucket of every step, with the same few sizes
def choose(nbytes: float, world: int, delay_s: float = 0.0, bandwidth: float | None = None,
           racks: tuple[int, ...] | None = None, uplink: float | None = None, crowded: float = 1.0) -> str:
    """The fastest algorithm by the model (the ring where they tie). bandwidth: the emulated
    links' bytes/s (None: loopback, whose messages cost less; emulated links burst);
    crowded: crowding()."""
    emulated = bandwidth is not None
    per = (LINK_MESSAGE_S if emulated else MESSAGE_S) * crowded
    b, burst = bandwidth or LOOPBACK_BYTES_S, EMULATED_BURST_S if emulated else 0.0
    return min(candidates(racks), key=lambda a: (predict(a, nbytes, world, delay_s, b, racks, uplink,
                                                         pieces(nbytes, a, emulated, crowded), per, burst),
                                                  a != "ring"))
