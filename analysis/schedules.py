"""Engines' exchanges played as flows over a cluster's links (analysis/fairshare.py): the
event-level counterpart of analysis/linkmodel.py's closed forms, for any number of hosts,
racks behind uplinks and a per-message latency.

A cluster is hosts w0.. (workers) and s0.. (separate shards), each with a link of `rate`
bytes/s each way; with racks, a rack's hosts reach the others through its uplink (`uplink`
bytes/s each way; None: as fast as the hosts' links together). A message from host a to host b
crosses a's way out, and b's way in; between racks also a's rack's way up and b's rack's way
down. Every message arrives `latency` seconds after its last byte left.

- ring all-reduce: 2(N-1) hops; in each, every host sends M/N to the next host in rank order,
  and a hop starts when the one before it has arrived everywhere (the ring's chunks go on only
  once received).
- parameter server: every worker pushes M/S to each shard at once, and once every push has
  arrived pulls M/S back from each (the phased exchange); a shard on a worker's own host
  (co-located) moves nothing over a link for that worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fairshare import Flow, simulate


@dataclass(frozen=True)
class Cluster:
    workers: int
    rate: float
    """Each host's link, bytes/s each way."""
    servers: int = 0
    """Shards on hosts of their own (separate placement); 0: none."""
    racks: int = 1
    uplink: float | None = None
    """Each rack's uplink, bytes/s each way (None: unlimited)."""
    latency: float = 0.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.rate <= 0 or self.servers < 0 or self.racks < 1 or self.latency < 0:
            raise ValueError(f"cluster {self}: workers and racks >= 1, rate > 0, servers and latency >= 0")
        if self.uplink is not None and self.uplink <= 0:
            raise ValueError(f"uplink={self.uplink}: must be > 0 (or None)")

    def rack(self, host: str) -> int:
        """Hosts are spread over the racks in turn, workers and shards alike (net.worker_rack's
        rank % racks)."""
        return int(host[1:]) % self.racks

    def capacity(self) -> dict[str, float]:
        hosts = [f"w{i}" for i in range(self.workers)] + [f"s{j}" for j in range(self.servers)]
        links = {f"{way}:{h}": self.rate for h in hosts for way in ("out", "in")}
        if self.racks > 1 and self.uplink is not None:
            links |= {f"{way}:r{r}": self.uplink for r in range(self.racks) for way in ("up", "down")}
        return links

    def path(self, a: str, b: str) -> tuple[str, ...]:
        crossing = self.racks > 1 and self.uplink is not None and self.rack(a) != self.rack(b)
        return (f"out:{a}",) + ((f"up:r{self.rack(a)}", f"down:r{self.rack(b)}") if crossing else ()) + (f"in:{b}",)


def _phase(cluster: Cluster, messages: list[tuple[str, str, float]]) -> float:
    """Seconds until every message (from, to, bytes), all sent at once, has arrived."""
    flows = [Flow(f"{i}", cluster.path(a, b), nbytes, latency=cluster.latency)
             for i, (a, b, nbytes) in enumerate(messages) if a != b]
    return max(simulate(flows, cluster.capacity()).values(), default=0.0)


def ring_allreduce(cluster: Cluster, nbytes: float) -> float:
    """Seconds of a ring all-reduce of nbytes over the cluster's workers."""
    n = cluster.workers
    if n == 1:
        return 0.0
    hop = _phase(cluster, [(f"w{i}", f"w{(i + 1) % n}", nbytes / n) for i in range(n)])
    return 2 * (n - 1) * hop  # every hop moves the same bytes over the same links


def parameter_server(cluster: Cluster, nbytes: float, shards: int) -> float:
    """Seconds of a phased push and pull of nbytes per worker to `shards` shards: on hosts of
    their own when the cluster has them (cluster.servers == shards), else shard j on worker
    j mod N's host."""
    if cluster.servers not in (0, shards):
        raise ValueError(f"the cluster has {cluster.servers} shard hosts for {shards} shards")
    where = [f"s{j}" if cluster.servers else f"w{j % cluster.workers}" for j in range(shards)]
    pushes = [(f"w{i}", where[j], nbytes / shards) for i in range(cluster.workers) for j in range(shards)]
    return _phase(cluster, pushes) + _phase(cluster, [(b, a, size) for a, b, size in pushes])


def gossip(cluster: Cluster, nbytes: float, topology: str) -> float:
    """Seconds of a D-PSGD exchange of nbytes to each out-neighbour at once, averaged over
    the graph's schedule (one-peer exponential: its log2 N steps)."""
    from allreduce.topology import peers, period

    n, steps = cluster.workers, period(topology, cluster.workers)
    return sum(_phase(cluster, [(f"w{i}", f"w{j}", nbytes) for i in range(n) for j in peers(topology, i, n, step)[0]])
               for step in range(steps)) / steps
