"""Communication time on a known link (`--net RATE`): no fitted bandwidth, the rate itself.

Every host sends and receives at RATE bits/s at once (full duplex). A step's communication
is one or more phases that follow each other; a phase lasts as long as the busiest host needs
for its busier direction. Bytes each host's link carries, with M gradient bytes per worker,
N workers and S shards:

- ring all-reduce (ours or the backend's, and ddp), one phase: every host sends and receives
  2(N-1)/N * M (reduce-scatter, then all-gather, each sending while it receives).
- parameter server, two phases: the pushes, then the pulls (a shard answers a pull with the
  parameters the pushes produced). A bound from above: a shard answers each key's pulls as
  soon as that key is updated, so pulls of keys pushed early overlap later pushes.
  Shards on hosts of their own: in each phase a worker's link carries M and a shard's N*M/S,
  so a step takes 2 * max(M, N*M/S) / RATE. Co-located, shard s on worker s mod N's host:
  what a worker pushes to its own host's shards and pulls back never leaves the host; host h
  holding c_h of the S shards sends M*(1 - c_h/S) of pushes and receives (N-1)*M*c_h/S of
  the others' in the push phase, and the reverse in the pull phase. With S = N that is
  (N-1)/N * M each way in each phase: the ring's 2(N-1)/N * M in all.
"""

from __future__ import annotations

from .results import Run

RING = ("ddp", "allreduce", "allreduce/library", "allreduce/ring")
PS = ("ps-sync", "ps-async", "ps-ssp")


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


def link_time(label: str, workers: int, servers: int, nbytes: float, rate_bits: float,
              placement: str = "colocated") -> float:
    """Seconds of communication per step: each phase's busiest host and direction, at rate_bits."""
    return sum(max(max(out, inn) for out, inn in phase.values())
               for phase in phases(label, workers, servers, nbytes, placement)) * 8 / rate_bits


def run_link_time(run: Run, nbytes: float) -> float | None:
    """link_time for a run on an emulated network (None for a loopback run)."""
    net = run.summary.get("network")
    if not net or not net.get("rate_bits"):
        return None
    servers = int(run.config.get("servers", 1)) if run.label in PS else 1
    return link_time(run.label, int(run.summary["workers"]), servers, nbytes, float(net["rate_bits"]),
                     net.get("placement", "colocated"))
