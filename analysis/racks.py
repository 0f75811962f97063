"""The link ideal of a run on racks (net.racks > 1): every byte a step moves, routed over the
two-tier network, and the busiest link's bytes over its rate. A host's link carries what it
sends and what it receives; a message between racks also crosses its rack's uplink to the
core and the other rack's down from it, at net.uplink.

- all-reduce and ddp: the plans of the algorithm that ran (allreduce/plancost.py's rounds of
  the plan for M bytes over the workers in their racks; the library's is Gloo's ring, in
  rank order, like ours), every message summed over the whole all-reduce;
- zero: the ring's plan, reduce-scatter and all-gather (zero-3: half as much again);
- gossip: each worker's model to each of its out-neighbours (one-peer exponential: each
  step's busiest link, averaged over its period of log2 N steps);
- parameter server: each worker pushes M/S to every shard and pulls as much back, shard j on
  its own host s<j> (placement=separate) or on worker j mod N's.

As linkmodel.link_time, it is the algorithm's ideal (every link busy all the communication,
full duplex), not psar's implementation: a run far above it has a gap to explain."""

from __future__ import annotations

from .results import Run, family


def _plan(run: Run, racks: tuple[int, ...]):
    """The plan of the algorithm the run's all-reduce ran (the library's and ddp's: the ring;
    zero's: the ring's two halves)."""
    from allreduce.auto import plan_of

    if family(run.label) == "sharded":
        return plan_of("ring", racks)
    algorithm = run.config.get("allreduce", {}).get("algorithm", "library") if run.spec.name != "ddp" else "ring"
    if algorithm == "auto":
        chosen = run.summary.get("algorithms_chosen") or {"ring": 1}
        algorithm = max(chosen, key=chosen.get)
    return plan_of("ring" if algorithm == "library" else algorithm, racks)


def flows(run: Run, nbytes: float, step: int = 0) -> dict[tuple[str, str], float]:
    """Bytes from host to host in one step of `run` (hosts by the network's names); `step`
    for a graph whose peers change each step (one-peer exponential gossip)."""
    net = run.summary["network"]
    rack_of = net["rack_of"]
    n = int(run.summary["workers"])
    out: dict[tuple[str, str], float] = {}
    kind = family(run.label)
    if kind in ("ring", "sharded"):  # sharded: the ring's two halves (zero-3: one all-gather more)
        from allreduce.plancost import rounds

        racks = tuple(rack_of[f"w{r}"] for r in range(n))
        plan = _plan(run, racks)
        numel, scale = int(nbytes), 1.5 if run.label == "zero-3" else 1.0
        for moves in rounds([plan(numel, r, n) for r in range(n)]):
            for i, j, mine, _ in moves:
                key = (f"w{i}", f"w{j}")
                out[key] = out.get(key, 0.0) + (mine.send[1] - mine.send[0]) * scale
        return out
    if kind == "gossip":  # each worker's model to its out-neighbours at this step
        from allreduce.topology import peers

        for w in range(n):
            for j in peers(run.label.split("/", 1)[1], w, n, step)[0]:
                out[(f"w{w}", f"w{j}")] = out.get((f"w{w}", f"w{j}"), 0.0) + nbytes
        return out
    s = int(run.config.get("servers", 1))
    separate = net.get("placement") == "separate"
    for w in range(n):
        for j in range(s):
            shard = f"s{j}" if separate else f"w{j % n}"
            if shard != f"w{w}":
                out[(f"w{w}", shard)] = out.get((f"w{w}", shard), 0.0) + nbytes / s
                out[(shard, f"w{w}")] = out.get((shard, f"w{w}"), 0.0) + nbytes / s
    return out


def link_ideal(run: Run, payload: float) -> dict | None:
    """{"seconds": the busiest link's bytes over its payload rate (payload: the TCP data per
    byte on the link, linkmodel.PAYLOAD), "uplink_bytes": the busiest uplink direction's
    bytes} for a run on racks; None for any other run."""
    net = run.summary.get("network") or {}
    if int(net.get("racks") or 1) < 2 or not net.get("rate_bits") or family(run.label) == "local":
        return None
    from .traffic import run_traffic  # reads model.pt with torch

    rack_of, host_bw = net["rack_of"], float(net["rate_bits"]) * payload / 8
    uplink_bw = float(net["uplink_bits"]) * payload / 8 if net.get("uplink_bits") else None
    from allreduce.topology import period

    nbytes = run_traffic(run).push
    steps = period(run.label.split("/", 1)[1], int(run.summary["workers"])) if family(run.label) == "gossip" else 1
    seconds = uplink = 0.0
    for step in range(steps):  # a graph whose peers change: each step's busiest link, averaged
        load: dict[tuple, float] = {}
        for (a, b), sent in flows(run, nbytes, step).items():
            for link in (("out", a), ("in", b)) + ((("up", rack_of[a]), ("down", rack_of[b]))
                                                   if rack_of[a] != rack_of[b] else ()):
                load[link] = load.get(link, 0.0) + sent
        seconds += max(v / (uplink_bw if k[0] in ("up", "down") and uplink_bw else host_bw)
                       for k, v in load.items() if uplink_bw or k[0] in ("out", "in")) / steps
        uplink += max((v for k, v in load.items() if k[0] in ("up", "down")), default=0.0) / steps
    return {"seconds": seconds, "uplink_bytes": uplink}

