"""Communication time on a known link (`--net RATE`): no fitted bandwidth, the rate itself.

Every host sends and receives at RATE bits/s at once (full duplex), of which the TCP payload
is PAYLOAD (the rest is the headers of each frame). A step's communication is one or more
phases that follow each other; a phase lasts as long as the busiest host needs for its
busier direction. Bytes each host's link carries, with M gradient bytes per worker, N
workers and S shards:

- ring all-reduce (ours or the backend's, and ddp), one phase: every host sends and receives
  2(N-1)/N * M (reduce-scatter, then all-gather, each sending while it receives).
- parameter server, two phases: the pushes, then the pulls (a shard answers a pull with the
  parameters the pushes produced). Shards on hosts of their own: in each phase a worker's
  link carries M and a shard's N*M/S, so the phases take 2 * max(M, N*M/S) / RATE.
  Co-located, shard s on worker s mod N's host: what a worker pushes to its own host's
  shards and pulls back never leaves the host; host h holding c_h of the S shards sends
  M*(1 - c_h/S) of pushes and receives (N-1)*M*c_h/S of the others' in the push phase, and
  the reverse in the pull phase. With S = N that is (N-1)/N * M each way in each phase: the
  ring's 2(N-1)/N * M in all.
  The phases follow each other as they are with ps.exchange=phased. With ps-sync's default
  pipelined exchange a shard answers each push message as soon as every worker has sent it,
  so where pushes and replies have links of their own (separate shards) the replies of
  early messages overlap later pushes: message i carrying the fraction f_i of the gradient,
  in the order they leave, is in at P * (f_1 + ... + f_i), P the push phase, and its reply
  takes P' * f_i after the reply before it (`overlapped`). Co-located, a reply shares its
  host's links with the pushes to that host's own shard, so nothing is gained: there, and
  wherever many hosts send to many at once, the phases are a bound from below (TCP does not
  share a link among several flows perfectly).
"""

from __future__ import annotations

from collections.abc import Sequence

from .results import Run

RING = ("ddp", "allreduce", "allreduce/library", "allreduce/ring")
PS = ("ps-sync", "ps-async", "ps-ssp")

PAYLOAD = 1448 / 1514
"""TCP payload per byte on the link: a 1500-byte IPv4 packet holds 1448 bytes of data (20 of
IP, 32 of TCP with timestamps) and leaves as a 1514-byte Ethernet frame, the length tc
shapes. A 200mbit link moves 191.3 Mbit/s of data; 192 were measured between two hosts."""


def phases(label: str, workers: int, servers: int, nbytes: float,
           placement: str = "colocated") -> list[dict[str, tuple[float, float]]]:
    """The step's phases, each {host: (bytes out, bytes in)}; hosts w0.. and, when separate, s0.."""
    n, m = workers, float(nbytes)
    if workers < 1 or servers < 1 or nbytes < 0:
        raise ValueError(f"workers={workers} and servers={servers} must be >= 1, nbytes={nbytes} >= 0")
    if placement not in ("colocated", "separate"):
        raise ValueError(f"placement {placement!r}: expected colocated or separate")
    if label == "local":
        return []
    if label in RING:
        each = 2 * (n - 1) / n * m
        return [{f"w{i}": (each, each) for i in range(n)}]
    if label not in PS:
        raise ValueError(f"unknown engine label {label!r}: expected local, {', '.join(RING + PS)}")
    s = servers
    if placement == "separate":
        push = {f"w{i}": (m, 0.0) for i in range(n)} | {f"s{j}": (0.0, n * m / s) for j in range(s)}
    else:
        held = [sum(1 for j in range(s) if j % n == i) for i in range(n)]
        push = {f"w{i}": (m * (1 - c / s), (n - 1) * m * c / s) for i, c in enumerate(held)}
    pull = {host: (inn, out) for host, (out, inn) in push.items()}
    return [push, pull]


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
              placement: str = "colocated", messages: Sequence[float] | None = None) -> float:
    """Seconds of communication per step: each phase's busiest host and direction, at the
    payload rate of rate_bits. messages: ps-sync's pipelined exchange, the fractions of the
    gradient its push messages carry in the order they leave (overlapped when separate)."""
    times = [max(max(out, inn) for out, inn in phase.values()) * 8 / (rate_bits * PAYLOAD)
             for phase in phases(label, workers, servers, nbytes, placement)]
    if messages and label == "ps-sync" and placement == "separate":
        return overlapped(times[0], times[1], messages)
    return sum(times)


def run_link_time(run: Run, nbytes: float) -> float | None:
    """link_time for a run on an emulated network (None for a loopback run), with its push
    messages when its ps-sync exchange was pipelined."""
    net = run.summary.get("network")
    if not net or not net.get("rate_bits"):
        return None
    servers = int(run.config.get("servers", 1)) if run.label in PS else 1
    messages = None
    if run.label == "ps-sync" and run.config.get("ps", {}).get("exchange", "pipelined") == "pipelined":
        # Here, not at the top: costmodel imports this module, and reads model.pt with torch.
        from .costmodel import push_messages
        messages = push_messages(run)
    return link_time(run.label, int(run.summary["workers"]), servers, nbytes, float(net["rate_bits"]),
                     net.get("placement", "colocated"), messages)
