"""Engines' exchanges played as flows over a cluster's links (analysis/fairshare.py): the
event-level counterpart of analysis/linkmodel.py's closed forms, for any number of hosts,
racks behind uplinks and a per-message latency.

A cluster is hosts w0.. (workers) and s0.. (separate shards), each with a link of `rate`
bytes/s each way; with racks, a rack's hosts reach the others through its uplink (`uplink`
bytes/s each way; None: as fast as the hosts' links together). A message from host a to host b
crosses a's way out, and b's way in; between racks also a's rack's way up and b's rack's way
down. Every message arrives `latency` seconds after its last byte left. With a `fabric`, every
message crosses it too: what all the hosts' links carry at once (a switch's backplane, or the
one machine whose kernel carries every emulated link: on 2 cores 0.6 to 1 GB/s, less than
four 2gbit links send).

- ring all-reduce: 2(N-1) hops; in each, every host sends M/N to the next host in rank order,
  and a hop starts when the one before it has arrived everywhere (the ring's chunks go on only
  once received).
- parameter server, phased (ps.exchange=phased): every worker pushes M/S to each shard at
  once, and once every push has arrived pulls M/S back from each; a shard on a worker's own
  host (co-located) moves nothing over a link for that worker.
- parameter server, pipelined (ps-sync's default): each shard's M/S is cut into keys; every
  worker streams its keys to each shard one after the other, and a shard answers a key to
  every worker once every worker's push of it has arrived, while later keys still come in.
  Hosts alike (same rack, same number of shards, a worker or none) are played as one class
  of flows (analysis/fairshare.py's fan), so 1024 workers cost what a few do.

A shard's own work on a message (Cluster.shard_message and shard_byte: its decode, checks,
update and reply) runs on one thread, one message at a time: the pipelined exchange plays
it as a flow of microseconds over the shard's thread (a link of 1e6 us a second) between a
push's arrival and its being counted in, and the phased one adds a shard's turn through the
pushes it takes between its two phases. On links of a few Gbit/s it is a few percent of a
step; with many workers on fast links it is what a shard's step waits on.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

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
    fabric: float | None = None
    """Bytes/s that every host's messages together can move (None: unlimited)."""
    shard_message: float = 0.0
    """A shard's own seconds for each message it takes (a push and its answer), whatever its
    size: its decode, checks, bookkeeping and reply. A shard takes its messages one at a
    time, on one thread, so its workers' messages queue for it (0: none)."""
    shard_byte: float = 0.0
    """A shard's own seconds for each byte of a message it takes (the update's pass over its
    memory), beside shard_message."""

    def __post_init__(self) -> None:
        if self.workers < 1 or self.rate <= 0 or self.servers < 0 or self.racks < 1 or self.latency < 0:
            raise ValueError(f"cluster {self}: workers and racks >= 1, rate > 0, servers and latency >= 0")
        if not (self.shard_message >= 0 and self.shard_byte >= 0):
            raise ValueError(f"cluster {self}: a shard's seconds a message and a byte must be >= 0")
        for name in ("uplink", "fabric"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 (or None)")

    def shard_us(self, nbytes: float) -> float:
        """Microseconds of a shard's own work on one message of nbytes (a push and its answer)."""
        return (self.shard_message + self.shard_byte * nbytes) * 1e6

    def rack(self, host: str) -> int:
        """Hosts are spread over the racks in turn, workers and shards alike (net.worker_rack's
        rank % racks)."""
        return int(host[1:]) % self.racks

    def capacity(self) -> dict[str, float]:
        hosts = [f"w{i}" for i in range(self.workers)] + [f"s{j}" for j in range(self.servers)]
        links = {f"{way}:{h}": self.rate for h in hosts for way in ("out", "in")}
        if self.racks > 1 and self.uplink is not None:
            links |= {f"{way}:r{r}": self.uplink for r in range(self.racks) for way in ("up", "down")}
        return links | ({"fabric": self.fabric} if self.fabric is not None else {})

    def path(self, a: str, b: str) -> tuple[str, ...]:
        crossing = self.racks > 1 and self.uplink is not None and self.rack(a) != self.rack(b)
        return (f"out:{a}",) + ((f"up:r{self.rack(a)}", f"down:r{self.rack(b)}") if crossing else ()) + (f"in:{b}",) \
            + (("fabric",) if self.fabric is not None else ())


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
    # every push is in at about the same moment, then each shard takes its remote ones in turn
    into, shards_on = Counter(b for a, b, _ in pushes if a != b), Counter(where)  # remote pushes, shards: by host
    taken = max((into[h] / shards_on[h] for h in into), default=0)
    return _phase(cluster, pushes) + taken * cluster.shard_us(nbytes / shards) / 1e6 \
        + _phase(cluster, [(b, a, size) for a, b, size in pushes])


def gossip(cluster: Cluster, nbytes: float, topology: str) -> float:
    """Seconds of a D-PSGD exchange of nbytes to each out-neighbour at once, averaged over
    the graph's schedule (one-peer exponential: its log2 N steps)."""
    from allreduce.topology import peers, period

    n, steps = cluster.workers, period(topology, cluster.workers)
    return sum(_phase(cluster, [(f"w{i}", f"w{j}", nbytes) for i in range(n) for j in peers(topology, i, n, step)[0]])
               for step in range(steps)) / steps


@dataclass(frozen=True)
class _Hosts:
    """A class of hosts alike: `n` of them in rack `rack`, each with a worker or not and
    `shards` shards."""
    name: str
    n: int
    rack: int
    worker: bool
    shards: int


def _host_classes(cluster: Cluster, shards: int) -> list[_Hosts]:
    """The cluster's hosts grouped by (rack, worker, shards): shard j on its own host when
    the cluster has shard hosts, else on worker j mod N's."""
    racks = cluster.racks if cluster.uplink is not None else 1
    on_worker = [0] * cluster.workers
    if not cluster.servers:
        for j in range(shards):
            on_worker[j % cluster.workers] += 1
    count: dict[tuple[int, bool, int], int] = {}
    for i, k in enumerate(on_worker):
        count[i % racks, True, k] = count.get((i % racks, True, k), 0) + 1
    for j in range(cluster.servers):
        count[j % racks, False, 1] = count.get((j % racks, False, 1), 0) + 1
    return [_Hosts(f"{'w' if worker else 's'}{k}@r{rack}", n, rack, worker, k)
            for (rack, worker, k), n in sorted(count.items())]


def remote_pairs(classes: list[_Hosts]) -> dict[tuple[str, str], tuple[int, int]]:
    """(worker class, shard class): (shards of that class remote to one such worker, workers
    of that class remote to one such shard host), where both are some."""
    pairs = {}
    for a in (c for c in classes if c.worker):
        for b in (c for c in classes if c.shards):
            same = a is b
            remote = (b.n * b.shards - (b.shards if same else 0), a.n - (1 if same else 0))
            if remote[0] and remote[1]:
                pairs[a.name, b.name] = remote
    return pairs


def released(keys: int, buckets: Sequence[tuple[float, float]]) -> list[float]:
    """When each of a shard's `keys` keys (in the order they leave) is released, from buckets
    [(seconds, share of the bytes)] in the order backward released them: key k once the
    buckets so far hold (k + 1) / keys of the bytes."""
    out, done, i = [], 0.0, 0
    for k in range(keys):
        while i < len(buckets) and done < (k + 1) / keys - 1e-9:
            done += buckets[i][1]
            i += 1
        out.append(buckets[i - 1][0] if buckets else 0.0)
    return out


def parameter_server_pipelined(cluster: Cluster, nbytes: float, shards: int, key_bytes: float,
                               window: int = 0, ready: Sequence[tuple[float, float]] = ()) -> float:
    """Seconds of ps-sync's pipelined exchange of nbytes per worker over `shards` shards, in
    keys of about key_bytes: every worker streams each shard its keys in turn, and a shard
    sends a key's new values to every worker once every worker's push of it is in. window: at
    most this many of a worker's keys unanswered at a shard (ps.window_mb over the key), a
    key waiting for the answer to the one `window` before it; 0: none. ready: the buckets
    [(seconds, share of the bytes)] as backward released them (a key leaves no sooner: see
    released); the seconds are then counted from backward's start; (): all at 0."""
    if cluster.servers not in (0, shards):
        raise ValueError(f"the cluster has {cluster.servers} shard hosts for {shards} shards")
    if key_bytes <= 0:
        raise ValueError(f"key_bytes={key_bytes}: must be > 0")
    classes = _host_classes(cluster, shards)
    keys = max(1, math.ceil(nbytes / shards / key_bytes))
    key = nbytes / shards / keys
    leaves = released(keys, ready) if ready else [0.0] * keys  # key k no sooner than leaves[k]
    pairs = remote_pairs(classes)
    if not pairs:
        return 0.0
    by_name = {c.name: c for c in classes}
    capacity = {f"{way}:{c.name}": cluster.rate for c in classes for way in ("out", "in")}
    if len({c.rack for c in classes}) > 1:
        capacity |= {f"{way}:r{c.rack}": cluster.uplink for c in classes for way in ("up", "down")}
    fabric = ("fabric",) if cluster.fabric is not None else ()
    if fabric:
        capacity["fabric"] = cluster.fabric
    taking = cluster.shard_us(key) > 0  # a shard's own time on each push, one at a time
    if taking:
        capacity |= {f"cpu:{c.name}": 1e6 for c in classes if c.shards}  # one shard's thread: 1e6 us a second

    def flow(name: str, src: _Hosts, dst: _Hosts, per_src: float, per_dst: float, start: float) -> Flow:
        """A class of flows: each src host sends per_src of them, each dst host takes per_dst
        (and the fabric carries all of them)."""
        up = (f"up:r{src.rack}", f"down:r{dst.rack}") if src.rack != dst.rack else ()
        return Flow(name, (f"out:{src.name}",) + up + (f"in:{dst.name}",) + fabric, key, start, cluster.latency,
                    (per_src,) + (src.n * per_src,) * len(up) + (per_dst,) + (src.n * per_src,) * len(fabric))

    def push(a: str, b: str, k: int, start: float) -> Flow:
        rs, rw = pairs[a, b]
        return flow(f"push {a} {b} {k}", by_name[a], by_name[b], rs, by_name[b].shards * rw, start)

    waiting = {(b, k): sum(1 for _, bb in pairs if bb == b) for b in {b for _, b in pairs} for k in range(keys)}
    sent, answered = {pair: 1 for pair in pairs}, {pair: 0 for pair in pairs}  # keys pushed, answered
    blocked: set[tuple[str, str]] = set()  # connections whose next key waits for an answer

    def send(a: str, b: str, start: float) -> list[Flow]:
        """The connection's next key, unless it has none or its window is full."""
        if sent[a, b] == keys:
            return []
        if window and sent[a, b] - answered[a, b] >= window:
            blocked.add((a, b))
            return []
        blocked.discard((a, b))
        sent[a, b] += 1
        return [push(a, b, sent[a, b] - 1, max(start, leaves[sent[a, b] - 1]))]

    def then(name: str, at: float) -> list[Flow]:
        kind, a, b, k = name.split(" ")
        k = int(k)
        if kind == "reply":
            answered[a, b] += 1
            return send(a, b, at) if (a, b) in blocked else []
        if kind == "push":
            started = send(a, b, at - cluster.latency)
            if taking:  # each shard takes the class's pushes of key k in turn
                return started + [Flow(f"take {a} {b} {k}", (f"cpu:{b}",), cluster.shard_us(key), at, 0.0,
                                       (pairs[a, b][1],))]
        else:
            started = []
        waiting[b, k] -= 1
        if not waiting[b, k]:  # every worker's push of key k is in: the shard answers it
            for (aa, bb), (rs, rw) in pairs.items():
                if bb == b:
                    started.append(flow(f"reply {aa} {b} {k}", by_name[b], by_name[aa],
                                        by_name[b].shards * rw, rs, at))
        return started

    arrived = simulate([push(a, b, 0, leaves[0]) for a, b in pairs], capacity, then)
    return max(t for name, t in arrived.items() if name.startswith("reply"))
