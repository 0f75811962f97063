"""The parameter server's exchange where no step waits for every worker (ps-async), played
over the cluster's links (analysis/fairshare.py).

Under sync every worker's push of a key must be in before a shard answers it, so the workers
go in lockstep and analysis/schedules.py plays them so. Under async a shard answers each
push as soon as it has applied it, and the workers drift apart: at any moment some push
while others are answered, so a shard's link carries both ways at once. Played in lockstep,
shards that hold one key of each worker answer only once every push is in: 2 M/B for M bytes
on links of B, where 16 workers measured about 1.2 M/B, and a shard's key in one message
1.93, 1.75 and 1.35 M/B at 2, 4 and 8 workers (docs/cost-model.md).

So one worker of each kind is played, against the others' load on average:

- every link's capacity, to it, is what the other workers' exchanges leave of it over a
  step of `period` seconds (a link shared by processor sharing gives a flow its capacity
  less the others' load; the caller finds the period, the step being its compute and this
  exchange), never less than its share of the link's bytes;
- its messages leave its host first come, first served, in the order it sends them (key by
  key, each to every remote shard), and a message held back by a shard's busy link leaves
  the rest of its own link to the next ones; each is answered as soon as it is in and the
  shard has taken it (its own time on a message, Cluster.shard_message and shard_byte, on a
  thread the others' messages take their part of, as they take their part of its links),
  and its answer comes back while later ones still leave.
"""

from __future__ import annotations

import math
from typing import Sequence

from .fairshare import Flow, priority_rates, simulate
from .schedules import Cluster, _host_classes, _Hosts, released, remote_pairs

BATCHES = 64
"""A worker's messages of one key to many shards are played in at most this many batches:
beyond, the last batch's answer, which is what the batching changes, is under 2% of the
exchange."""


def _across(cluster: Cluster, x: _Hosts, y: _Hosts) -> bool:
    """Whether traffic between hosts of x and y crosses rack uplinks."""
    return cluster.racks > 1 and cluster.uplink is not None and x.rack != y.rack


def _shared(cluster: Cluster, x: _Hosts, y: _Hosts, moved: float) -> list[tuple[str, float]]:
    """The links beyond the hosts' own that `moved` bytes each way between hosts of x and y
    cross, with their bytes: both racks' uplinks each way, and the fabric (both ways)."""
    links = [(f"{way}:r{rack}", moved) for rack in (x.rack, y.rack) for way in ("up", "down")] \
        if _across(cluster, x, y) else []
    return links + ([("fabric", 2 * moved)] if cluster.fabric is not None else [])


def _loads(cluster: Cluster, by_name: dict[str, _Hosts], pairs: dict, per: float) -> dict[str, float]:
    """Bytes a step puts on each link (one host of each class; each rack's uplink; the
    fabric), every worker's exchange together: `per` bytes each way between a worker and each
    remote shard."""
    load: dict[str, float] = {}
    for (a, b), (rs, rw) in pairs.items():
        wa, sb = by_name[a], by_name[b]
        links = [(f"{way}:{a}", rs * per) for way in ("out", "in")]  # its pushes out, their answers in
        links += [(f"{way}:{b}", sb.shards * rw * per) for way in ("out", "in")]  # the pushes in, the answers out
        for link, nbytes in links + _shared(cluster, wa, sb, wa.n * rs * per):
            load[link] = load.get(link, 0.0) + nbytes
    return load


def _own(cluster: Cluster, a: _Hosts, by_name: dict[str, _Hosts], pairs: dict, per: float) -> tuple[dict, dict]:
    """Bytes a step of one worker of class a puts on links: ({its own host's ways, the rack
    uplinks, the fabric: bytes}, {shard class: bytes each way to and from one remote host of it})."""
    own: dict[str, float] = {}
    remote: dict[str, float] = {}
    for (wa, b), (rs, _) in pairs.items():
        if wa != a.name:
            continue
        sb = by_name[b]
        remote[b] = sb.shards * per
        links = [(f"out:{a.name}", rs * per), (f"in:{a.name}", rs * per)]
        for link, nbytes in links + _shared(cluster, a, sb, rs * per):
            own[link] = own.get(link, 0.0) + nbytes
    return own, remote


def _left(capacity: float, own: float, total: float, period: float) -> float:
    """What a link of `capacity` leaves to a worker that moves `own` of the `total` bytes it
    carries a step of `period` seconds: what the others' bytes leave of it on average, never
    less than its share of the bytes."""
    others = max(0.0, total - own)
    return max(capacity - others / period, capacity * own / (own + others) if own + others > 0 else capacity)


def _capacity(cluster: Cluster, link: str) -> float:
    if link == "fabric":
        return float(cluster.fabric)
    if link.startswith(("up:", "down:")):
        return float(cluster.uplink)
    return cluster.rate


def parameter_server_async(cluster: Cluster, nbytes: float, shards: int, key_bytes: float, period: float,
                           ready: Sequence[tuple[float, float]] = ()) -> float:
    """Seconds of one worker's exchange of nbytes over `shards` shards in keys of about
    key_bytes, under async, its steps taking `period` seconds (see the module's text; the
    mean over the kinds of worker, by their numbers). ready: the buckets [(seconds, share of
    the bytes)] as backward released them (see schedules.released); (): all at 0."""
    if cluster.servers not in (0, shards):
        raise ValueError(f"the cluster has {cluster.servers} shard hosts for {shards} shards")
    if key_bytes <= 0 or period <= 0:
        raise ValueError(f"key_bytes={key_bytes} and period={period}: must be > 0")
    classes = _host_classes(cluster, shards)
    pairs = remote_pairs(classes)
    if not pairs:
        return 0.0
    keys = max(1, math.ceil(nbytes / shards / key_bytes))
    key, per = nbytes / shards / keys, nbytes / shards
    leaves = released(keys, ready) if ready else [0.0] * keys
    by_name = {c.name: c for c in classes}
    total = _loads(cluster, by_name, pairs, per)
    ends, counts = [], []
    for a in (c for c in classes if c.worker and any(wa == c.name for wa, _ in pairs)):
        ends.append(_one_worker(cluster, a, by_name, pairs, total, per, key, keys, leaves, period))
        counts.append(a.n)
    return sum(e * n for e, n in zip(ends, counts)) / sum(counts)


def _one_worker(cluster: Cluster, a: _Hosts, by_name: dict[str, _Hosts], pairs: dict, total: dict, per: float,
                key: float, keys: int, leaves: list[float], period: float) -> float:
    """When one worker of class a has every answer: its keys played against the others' load."""
    own, remote = _own(cluster, a, by_name, pairs, per)
    capacity = {link: _left(_capacity(cluster, link), nbytes, total.get(link, 0.0), period)
                for link, nbytes in own.items()}  # its own host's ways, the uplinks, the fabric
    fabric = ("fabric",) if cluster.fabric is not None else ()

    def crossing(src: _Hosts, dst: _Hosts) -> tuple[str, ...]:
        return (f"up:r{src.rack}", f"down:r{dst.rack}") if _across(cluster, src, dst) else ()

    # Its messages in the order it sends them, key by key, each to every remote shard, in
    # batches of alike messages (at most BATCHES a key; fairshare's fan), each batch into
    # shards' links of its own, served first come, first served.
    sends = [(k, b, rs) for k in range(keys) for (wa, b), (rs, _) in sorted(pairs.items()) if wa == a.name]
    size = math.ceil(sum(rs for k, _, rs in sends if k == 0) / BATCHES)
    batches = [(k, b, first // size, min(size, rs - first)) for k, b, rs in sends for first in range(0, rs, size)]
    taking = cluster.shard_us(key) > 0  # a shard's own time on each message, one at a time
    taken = {b: sum(rw for (_, bb), (_, rw) in pairs.items() if bb == b) * keys * cluster.shard_us(key)
             for b in remote}  # us a step all workers' messages take of one shard of class b
    for _, b, slot, _ in batches:
        capacity[f"in:{b}#{slot}"] = _left(cluster.rate, remote[b], total[f"in:{b}"], period) / by_name[b].shards
        capacity[f"out:{b}#{slot}"] = _left(cluster.rate, remote[b], total[f"out:{b}"], period) / by_name[b].shards
        if taking:  # one shard's thread (1e6 us a second), less what the others' messages take
            capacity[f"cpu:{b}#{slot}"] = _left(1e6, keys * cluster.shard_us(key), taken[b], period)

    def flow(name: str, i: int, start: float) -> Flow:
        _, b, slot, count = batches[i]
        shard = by_name[b]
        if name == "push":
            links = (f"out:{a.name}",) + crossing(a, shard) + (f"in:{b}#{slot}",) + fabric
        else:
            links = (f"out:{b}#{slot}",) + crossing(shard, a) + (f"in:{a.name}",) + fabric
        fans = tuple(1.0 if "#" in link else float(count) for link in links)
        return Flow(f"{name} {i}", links, key, start, cluster.latency, fans, priority=i)

    def then(name: str, at: float) -> list[Flow]:
        kind, i = name.split(" ")
        if kind == "push" and taking:
            _, b, slot, _ = batches[int(i)]
            return [Flow(f"take {i}", (f"cpu:{b}#{slot}",), cluster.shard_us(key), at, 0.0, (1.0,), priority=int(i))]
        return [flow("answer", int(i), at)] if kind in ("push", "take") else []

    arrived = simulate([flow("push", i, leaves[k]) for i, (k, *_) in enumerate(batches)], capacity, then,
                       priority_rates)
    return max(t for name, t in arrived.items() if name.startswith("answer"))
