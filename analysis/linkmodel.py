"""Communication time on a known link (`--net RATE`): no fitted bandwidth, the rate itself.

Every host sends and receives at RATE bits/s at once (full duplex), of which the TCP payload
is PAYLOAD (the rest is the headers of each frame). Bytes each host's link carries per step,
with M gradient bytes per worker, N workers and S shards (`phases`):

- ring all-reduce (ours or the backend's, and ddp): every host sends and receives
  2(N-1)/N * M (reduce-scatter, then all-gather, each sending while it receives); rows
  all-gathered besides (allreduce.sparse=allgather): each host's block to the N-1 others,
  G = (N-1) * block each way, read off the run.
- parameter server: the pushes (M each), and the pulls that return the parameters they
  produced (M, or for row-sparse tables the rows asked for: a run's own bytes).
  Shards on hosts of their own: a worker's link carries M each way, a shard's N*M/S.
  Co-located, shard s on worker s mod N's host: what a worker pushes to its own host's
  shards and pulls back never leaves the host; host h holding c_h of the S shards sends
  M*(1 - c_h/S) of pushes and receives (N-1)*M*c_h/S of the others', and the reverse for
  the pulls. With S = N that is 2(N-1)/N * M each way: the ring's.

`link_time` is the algorithm's ideal, the theory column of every table: a perfect
implementation on these links, each direction busy all step (a shard answers each small
piece once every worker has pushed it, while later pieces arrive), so the step's
communication lasts as long as the busiest host needs for its busier direction: the ring
2(N-1)/N * M/B, separate shards max(M, N*M/S)/B, co-located shards as the ring. A run far
above it is psar's gap to close, not a match to report.

`psar_link_time` models psar's own exchange beside it: pushes and pulls as two phases that
follow each other (ps.exchange=phased, ps-async and ps-ssp), each as long as its busiest link
needs; ps-sync's pipelined exchange with separate shards overlaps them message by message
(`overlapped`), the messages' sizes read off the run (costmodel.push_messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from experiments.engines import label_info

from .results import Run, family

if TYPE_CHECKING:
    from .traffic import Traffic

PAYLOAD = 1448 / 1514
"""TCP payload per byte on the link: a 1500-byte IPv4 packet holds 1448 bytes of data (20 of
IP, 32 of TCP with timestamps) and leaves as a 1514-byte Ethernet frame, the length tc
shapes. A 200mbit link moves 191.3 Mbit/s of data; 192 were measured between two hosts."""


def phases(label: str, workers: int, servers: int, nbytes: float,
           placement: str = "colocated", pull_bytes: float | None = None,
           gathered: float = 0.0) -> list[dict[str, tuple[float, float]]]:
    """The step's phases, each {host: (bytes out, bytes in)}; hosts w0.. and, when separate,
    s0... nbytes: M, what each worker all-reduces or pushes; pull_bytes: what a ps worker
    pulls (default M); gathered: bytes each host sends and receives in an all-gather."""
    n, m = workers, float(nbytes)
    q = m if pull_bytes is None else float(pull_bytes)
    if workers < 1 or servers < 1 or nbytes < 0 or q < 0 or gathered < 0:
        raise ValueError(f"workers={workers} and servers={servers} must be >= 1, nbytes={nbytes}, "
                         f"pull_bytes={pull_bytes} and gathered={gathered} >= 0")
    if placement not in ("colocated", "separate"):
        raise ValueError(f"placement {placement!r}: expected colocated or separate")
    kind = family(label)
    if kind == "local":
        return []
    if kind == "ring":
        each = 2 * (n - 1) / n * m + gathered
        return [{f"w{i}": (each, each) for i in range(n)}]
    if kind == "sharded":  # a reduce-scatter of the gradient, an all-gather of the values (zero-3: two)
        each = (n - 1) / n * m
        return [{f"w{i}": (each, each) for i in range(n)}] * (3 if label == "zero-3" else 2)
    if kind == "gossip":  # each worker's model to each out-neighbour, at once
        each = gossip_degree(label, n) * m
        return [{f"w{i}": (each, each) for i in range(n)}]
    s = servers

    def pushes(b: float) -> dict[str, tuple[float, float]]:
        if placement == "separate":
            return {f"w{i}": (b, 0.0) for i in range(n)} | {f"s{j}": (0.0, n * b / s) for j in range(s)}
        held = [sum(1 for j in range(s) if j % n == i) for i in range(n)]
        return {f"w{i}": (b * (1 - c / s), (n - 1) * b * c / s) for i, c in enumerate(held)}

    pull = {host: (inn, out) for host, (out, inn) in pushes(q).items()}
    return [pushes(m), pull]


def gossip_degree(label: str, workers: int) -> int:
    """The models a gossip/TOPOLOGY worker sends each step (every graph here is regular)."""
    from allreduce.topology import peers

    return len(peers(label_info(label)[1].name.split("/", 1)[1], 0, workers, 0)[0])


def overlapped(push_s: float, pull_s: float, fractions: Sequence[float]) -> float:
    """Push and pull phases of push_s and pull_s on links of their own, the gradient leaving in
    messages carrying `fractions` of it in that order, each answered once it is in."""
    total = float(sum(fractions))
    if not fractions or total <= 0 or any(f < 0 for f in fractions):
        raise ValueError(f"message fractions {list(fractions)}: expected some, >= 0, not all 0")
    pushed = end = 0.0
    for f in fractions:
        pushed += push_s * f / total
        end = max(end, pushed) + pull_s * f / total
    return end


def link_time(label: str, workers: int, servers: int, nbytes: float, rate_bits: float,
              placement: str = "colocated", pull_bytes: float | None = None, gathered: float = 0.0) -> float:
    """The algorithm's ideal seconds of communication per step: every phase's bytes at once,
    full duplex, the busiest host's busier direction at the payload rate of rate_bits."""
    steps = phases(label, workers, servers, nbytes, placement, pull_bytes, gathered)
    hosts = {h for phase in steps for h in phase}
    worst = max((max(sum(p[h][0] for p in steps if h in p), sum(p[h][1] for p in steps if h in p))
                 for h in hosts), default=0.0)
    return worst * 8 / (rate_bits * PAYLOAD)


def psar_link_time(label: str, workers: int, servers: int, nbytes: float, rate_bits: float,
                   placement: str = "colocated", messages: Sequence[float] | None = None,
                   pull_bytes: float | None = None, gathered: float = 0.0) -> float:
    """psar's exchange: each phase's busiest host and direction, the phases one after the
    other, at the payload rate of rate_bits. messages: ps-sync's pipelined exchange, the
    fractions of the gradient its push messages carry in the order they leave (overlapped
    when separate)."""
    times = [max(max(out, inn) for out, inn in phase.values()) * 8 / (rate_bits * PAYLOAD)
             for phase in phases(label, workers, servers, nbytes, placement, pull_bytes, gathered)]
    spec = label_info(label)[0]
    if messages and spec.family == "ps" and spec.synchronous and placement == "separate":
        return overlapped(times[0], times[1], messages)
    return sum(times)


def _network(run: Run) -> dict | None:
    net = run.summary.get("network")
    return net if net and net.get("rate_bits") else None


def _shape(run: Run) -> tuple[str, int, int]:
    servers = int(run.config.get("servers", 1)) if family(run.label) == "ps" else 1
    return run.label, int(run.summary["workers"]), servers


def run_link_time(run: Run, traffic: "Traffic") -> float | None:
    """link_time, the ideal, for a run on an emulated network (None for a loopback run), of
    its traffic (costmodel.run_traffic)."""
    net = _network(run)
    if net is None:
        return None
    if int(net.get("racks") or 1) > 1:  # two tiers: the busiest link, uplinks included
        from .racks import link_ideal

        return link_ideal(run, PAYLOAD)["seconds"]
    return link_time(*_shape(run), traffic.push, float(net["rate_bits"]), net.get("placement", "colocated"),
                     traffic.pull, traffic.gathered)


def run_psar_link_time(run: Run, traffic: "Traffic") -> float | None:
    """psar_link_time for a run on an emulated network (None for a loopback run, and for racks,
    which it does not model), with its push messages when its ps-sync exchange was pipelined
    (None where they cannot be read off the run: traffic.push_messages)."""
    net = _network(run)
    if net is None or int(net.get("racks") or 1) > 1:
        return None
    messages = None
    if run.spec.family == "ps" and run.spec.synchronous and \
            run.config.get("ps", {}).get("exchange", "pipelined") == "pipelined":
        from .traffic import push_messages  # here: it reads model.pt with torch
        messages = push_messages(run)
        if messages is None:  # its keys were cut otherwise: which messages overlapped is not known
            return None
    return psar_link_time(*_shape(run), traffic.push, float(net["rate_bits"]), net.get("placement", "colocated"),
                          messages, traffic.pull, traffic.gathered)
