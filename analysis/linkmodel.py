"""Communication time on a known link (`--net RATE`): no fitted bandwidth, the rate itself.

Every host sends and receives at RATE bits/s at once (full duplex), so one step's
communication lasts as long as the busiest host needs for its busier direction. Bytes each
host's link carries per step, with M gradient bytes per worker, N workers and S shards:

- ring all-reduce (ours or the backend's, and ddp): every host sends and receives
  2(N-1)/N · M (reduce-scatter, then all-gather).
- parameter server, shards on hosts of their own: a worker sends M (its push) and receives M
  (its pull); a shard's host receives N·M/S and sends N·M/S.
- co-located, shard s on worker s mod N's host: what a worker pushes to its own host's shards
  and pulls back from them never leaves the host; host h holding c_h of the S shards sends
  M·(1 - c_h/S) of pushes plus (N-1)·M·c_h/S of replies to the others, and receives as much.
  With S = N that is 2(N-1)/N · M, the ring's; with S = 1 shard 0's host carries (N-1)·M.
"""

from __future__ import annotations

from .results import Run

RING = ("ddp", "allreduce", "allreduce/library", "allreduce/ring")
PS = ("ps-sync", "ps-async", "ps-ssp")


def host_bytes(label: str, workers: int, servers: int, nbytes: float,
               placement: str = "colocated") -> dict[str, tuple[float, float]]:
    """{host: (bytes out, bytes in)} of one step; hosts w0.. and, when separate, s0.."""
    n, m = workers, float(nbytes)
    if workers < 1 or servers < 1 or nbytes < 0:
        raise ValueError(f"workers={workers} and servers={servers} must be >= 1, nbytes={nbytes} >= 0")
    if label == "local" or n == 1 and label in RING:
        return {f"w{i}": (0.0, 0.0) for i in range(n)}
    if label in RING:
        each = 2 * (n - 1) / n * m
        return {f"w{i}": (each, each) for i in range(n)}
    if label not in PS:
        raise ValueError(f"unknown engine label {label!r}: expected local, {', '.join(RING + PS)}")
    s = servers
    if placement == "separate":
        hosts = {f"w{i}": (m, m) for i in range(n)}
        hosts.update({f"s{j}": (n * m / s, n * m / s) for j in range(s)})
        return hosts
    if placement != "colocated":
        raise ValueError(f"placement {placement!r}: expected colocated or separate")
    held = [sum(1 for j in range(s) if j % n == i) for i in range(n)]
    return {f"w{i}": (m * (1 - c / s) + (n - 1) * m * c / s,) * 2 for i, c in enumerate(held)}


def link_time(label: str, workers: int, servers: int, nbytes: float, rate_bits: float,
              placement: str = "colocated") -> float:
    """Seconds of communication per step: the busiest host's busier direction at rate_bits."""
    busiest = max(max(out, inn) for out, inn in host_bytes(label, workers, servers, nbytes, placement).values())
    return busiest * 8 / rate_bits


def run_link_time(run: Run, nbytes: float) -> float | None:
    """link_time for a run on an emulated network (None for a loopback run)."""
    net = run.summary.get("network")
    if not net or not net.get("rate_bits"):
        return None
    servers = int(run.config.get("servers", 1)) if run.label in PS else 1
    return link_time(run.label, int(run.summary["workers"]), servers, nbytes, float(net["rate_bits"]),
                     net.get("placement", "colocated"))
