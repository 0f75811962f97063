"""`psar predict`: measured runs carried to other worker counts and links.

For each engine, a step is its compute plus its exchange played over the target cluster's
links (analysis/schedules.py: every message a flow, links shared max-min fairly, racks behind
their uplinks, latency per hop). Both are read off the runs given: the compute is the median
of step_s - comm_s of the engine's runs (costmodel.compute_time); the model's bytes M are
model.pt's; and the exchange is scaled by the runs' own ratio of measured communication to
the same schedule played on the cluster they ran on (their rate, workers and shards), so that
what psar's implementation adds to the ideal (copies, a shard's work) is carried along rather
than fitted anew. A collective's messages' fixed cost (fixed_cost) is added apart, since it
grows with the hops, not the bytes (the backend's collectives' own, or psar's, Target.costed).
Where one machine emulated every host of the runs, all their links together carry no more than
its kernel moves: a cluster's fabric (analysis/schedules.py), which `psar compare predict`
measures before its grid. A run that recorded when its backward released each
gradient bucket (all-reduce, parameter server) plays its buckets from those times
(analysis/overlap.py): the step waits only for what ends after backward, on the target as on
its own cluster. A
parameter server's exchange is played as its runs' settings run it: pipelined by keys with
the workers' window (ps-sync's default), or phased; under ps-async, whose shards answer each
push at once, with the workers drifting apart (analysis/schedules_async.py), at the pace
their step sets (drifting; a run's own measured step in its calibration). ps-ssp, whose
bound holds its workers within a few clocks of each other, is played in lockstep.
An engine with no run of its own takes the compute of the runs' first engine and a ratio of
1 (the ideal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import median
from typing import Callable, Sequence

from .costmodel import compute_time
from .hostcpu import host_cpu
from .overlap import Timeline, exposed, median_timeline, solve_ratio, timeline
from .results import Run, family
from .schedules import Cluster, gossip, parameter_server, parameter_server_pipelined, ring_allreduce
from .schedules_async import parameter_server_async
from .traffic import gradient_bytes


@dataclass(frozen=True)
class Target:
    workers: int
    rate: float
    """Bytes/s of each host's link."""
    servers: int = 1
    placement: str = "colocated"
    racks: int = 1
    uplink: float | None = None
    latency: float = 0.0
    message: float | None = None
    """A message's fixed cost to a rank that sends or receives it, seconds (None:
    allreduce/auto.py's LINK_MESSAGE_S, measured on this project's emulated links)."""
    fabric: float | None = None
    """Bytes/s that all the hosts' messages together can move (analysis/schedules.Cluster;
    None: unlimited)."""
    own_message: float | None = None
    """A message's fixed cost in psar's own collectives (an allreduce.algorithm other than the
    library's, zero.algorithm=ring: a hop is Python's work as well as the backend's), seconds
    (None: `message`)."""
    shard_message: float | None = None
    """A parameter-server shard's own seconds on each message it takes, whatever its size
    (analysis/schedules.Cluster.shard_message; None: SHARD_MESSAGE_S)."""
    shard_byte: float | None = None
    """A shard's own seconds on each byte of a message (None: SHARD_BYTE_S)."""

    def costed(self, own: bool) -> "Target":
        """This target with a message costing what it does in psar's own collectives (own) or
        in the backend's."""
        return replace(self, message=self.own_message) if own and self.own_message is not None else self

    def cluster(self, engine_family: str) -> Cluster:
        ps = engine_family == "ps"
        separate = ps and self.placement == "separate"
        shard = (_given(self.shard_message, SHARD_MESSAGE_S), _given(self.shard_byte, SHARD_BYTE_S)) if ps else (0.0, 0.0)
        return Cluster(self.workers, self.rate, self.servers if separate else 0, self.racks, self.uplink, self.latency,
                       self.fabric, *shard)


SHARD_MESSAGE_S, SHARD_BYTE_S = 42.6e-6, 118.0e-6 / 2**20
"""A shard's own time on a push+pull, by default: bench_shard's fit to `psar bench`'s legs
on this project's 2-core machine (ps_legs' ps_thread_us, the shard's thread's CPU from one
push+pull's send to the next, at 1 KiB, 1 MiB and 4 MiB, two runs: 41.3, 190.7, 481.2 and
42.1, 183.0, 464.4 us), an async shard's compiled path one message at a time. A sync
shard's messages take it longer (in one process, quickstart's 4 keys, 2 workers: 17 us a
push+pull in the compiled path against async's 7; psar bench's shard_loop), which this
leaves to its runs' ratio."""


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def _ps_settings(settings: dict | None) -> dict:
    """The ps settings given over ps.config.PSConfig's defaults."""
    from ps.config import PSConfig

    return {**PSConfig().__dict__, **(settings or {})}


def ps_keys(settings: dict, sync: bool, rate: float) -> tuple[float, int]:
    """(key bytes, window in keys; 0: none) of a parameter server's pipelined exchange with
    the ps settings given, on links of `rate` bytes/s, as its workers cut and hold them
    (ps.config.key_mb and sync_window)."""
    from ps.config import key_mb, sync_window

    ps = _ps_settings(settings)
    key = key_mb(float(ps["chunk_mb"]), rate * 8)
    window = sync_window(float(ps["window_mb"]), float(ps["bucket_kb"]), key, rate * 8, ps["order"])[0] if sync else 0.0
    return key * (1 << 20), max(1, int(window // key)) if window else 0


ASYNC = ("ps-async",)
"""The parameter-server engines whose workers drift apart, their shards answering each push
at once: played so (analysis/schedules_async.py) where their step's pace is known. Not
ps-ssp: runs of it (staleness 2, mlp-mid [256,256], 200mbit, from 2 workers to 4 and 8)
were played within 3% and 7% in lockstep, 15% and 22% short drifting."""


def async_message(ps: dict | None, nbytes: float, target: Target, key: float) -> float:
    """Bytes of an async worker's message to one shard: its keys in one of the step's buckets
    (ps.bucket_kb; a shard answers the message once it has applied all of them), never less
    than a key."""
    bucket = float(_ps_settings(ps)["bucket_kb"]) * 1024
    buckets = max(1, math.ceil(nbytes / bucket)) if bucket > 0 else max(1, math.ceil(nbytes / key))
    return max(key, nbytes / target.servers / buckets)


def _ps_played(label: str, cluster: Cluster, target: Target, nbytes: float, ps: dict | None, period: float | None,
               ready: Sequence[tuple[float, float]] = ()) -> float:
    """Seconds of a parameter server's pipelined exchange on cluster (the target's, or its
    links slowed), in the keys and window its workers take on the target's links: drifting
    apart where label is ASYNC and period known, else in lockstep; ready: its buckets."""
    key, window = ps_keys(ps or {}, label == "ps-sync", target.rate)
    if label in ASYNC and period is not None:
        return parameter_server_async(cluster, nbytes, target.servers, async_message(ps, nbytes, target, key), period,
                                      ready)
    return parameter_server_pipelined(cluster, nbytes, target.servers, key, window, ready)


def exchange(label: str, target: Target, nbytes: float, ps: dict | None = None, period: float | None = None) -> float:
    """Seconds of engine label's exchange of a step on the target cluster; ps: the engine's
    ps settings (None: the defaults); period: the step's seconds, by which an async engine's
    workers drift apart (None: played in lockstep)."""
    kind = family(label)
    cluster = target.cluster(kind)
    if kind == "local":
        return 0.0
    if kind == "ps":
        if label == "ps-sync" and (ps or {}).get("exchange") == "phased":
            return parameter_server(cluster, nbytes, target.servers)
        return _ps_played(label, cluster, target, nbytes, ps, period)
    if kind == "gossip":
        return gossip(cluster, nbytes, label.split("/", 1)[1])
    return ring_allreduce(cluster, nbytes) * (1.5 if label == "zero-3" else 1.0)


@dataclass(frozen=True)
class Machine:
    """What the machines that runs ran on cost, where measured (None: the default): a
    message's fixed cost in the backend's collectives and in psar's own, seconds
    (bench_message), and what all their links carried at once where one machine emulated
    them, bytes/s (bench_fabric)."""
    message: float | None = None
    own_message: float | None = None
    fabric: float | None = None
    shard_message: float | None = None
    shard_byte: float | None = None
    """A shard's own seconds on a message and on each of its bytes (bench_shard)."""

    @classmethod
    def from_bench(cls, path) -> "Machine":
        """What `psar bench`'s report (bench.json) says of its machines: both messages' costs,
        where it measured one the fabric, and where it timed them a shard's own."""
        return cls(bench_message(path), bench_message(path, own=True), bench_fabric(path), *bench_shard(path))


def _own_target(run: Run, machine: Machine = Machine()) -> Target:
    """The cluster a run ran on, on `machine`, its message's cost the one of the collectives
    the run used."""
    net = run.summary.get("network") or {}
    config = run.config.get("net") or {}
    rate = float(net.get("rate_bits") or 0) / 8
    if not rate:
        raise ValueError(f"{run.path} ran on loopback: predict needs runs on an emulated network (--net RATE)")
    return Target(int(run.summary["workers"]), rate, int(run.summary.get("servers") or 1),
                  config.get("placement", "colocated"), int(config.get("racks") or 1),
                  float(net["uplink_bits"]) / 8 if net.get("uplink_bits") else None,
                  float(config.get("latency_ms") or 0) / 1e3, machine.message, machine.fabric,
                  machine.own_message, machine.shard_message, machine.shard_byte).costed(own_collectives(run))


def own_collectives(run: Run) -> bool:
    """Whether the run's collectives are psar's own (an allreduce.algorithm other than the
    library's, zero.algorithm other than library) rather than the backend's."""
    if run.engine == "zero":
        return (run.config.get("zero") or {}).get("algorithm", "library") != "library"
    return family(run.label) == "ring" and run.label != "allreduce/library"


def fixed_cost(label: str, target: Target) -> float:
    """Seconds of the messages' fixed cost on a step's critical path: a collective's hops (one
    all-reduce's 2(N-1); ZeRO stage 3's 3(N-1); gossip's one exchange with its out-neighbours),
    each costing a rank a message sent and one received, target.message each (by default
    LINK_MESSAGE_S, the fixed cost measured on emulated links, allreduce/auto.py). A parameter
    server's messages are left to the calibration's ratio."""
    from allreduce.auto import LINK_MESSAGE_S

    from .linkmodel import gossip_degree

    n, kind = target.workers, family(label)
    if n == 1 or kind in ("local", "ps"):
        return 0.0
    if kind == "gossip":
        rounds = gossip_degree(label, n)
    else:
        rounds = 3 * (n - 1) if label == "zero-3" else 2 * (n - 1)
    return rounds * 2 * (LINK_MESSAGE_S if target.message is None else target.message)


def bench_message(path, own: bool = False) -> float:
    """A message's fixed cost, seconds, read off `psar bench`'s report (bench.json) from the
    target's machines: half the fitted latency of one step of its all-reduce (a step is a
    message sent and one received), the backend's own, else psar's ring's; own: psar's ring's
    (psar's own collectives), else the backend's."""
    from .costmodel import CostModel

    model = CostModel.from_bench(path)
    fit = (model.ring or model.library) if own else (model.library or model.ring)
    if fit is None:
        raise ValueError(f"{path} has no all-reduce rows to read a message's cost from")
    return max(fit.alpha_s, 0.0) / 2


def bench_shard(path) -> tuple[float | None, float | None]:
    """(seconds a message, seconds a byte) of a shard's own time on a push+pull, fitted to the
    legs in `psar bench`'s report (bench.json's ps_legs at each size: ps_thread_us, its
    thread's CPU from one send to the next, else ps_server_us, its receive to its send) by
    least squares of the relative error (costmodel.fit_line), so that 1 KiB counts as much as
    4 MiB; (None, None) where it timed fewer than two sizes."""
    import json
    from pathlib import Path

    from .costmodel import fit_line

    try:
        legs = json.loads(Path(path).read_text()).get("ps_legs") or []
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"cannot read bench report {path}: {err}") from None
    rows = [r for r in legs if isinstance(r, dict) and isinstance(r.get("bytes"), (int, float))]
    field = "ps_thread_us" if rows and all(isinstance(r.get("ps_thread_us"), (int, float)) for r in rows) \
        else "ps_server_us"
    points = [(float(r["bytes"]), float(r[field]) / 1e6) for r in rows
              if isinstance(r.get(field), (int, float)) and r[field] > 0]
    if len({x for x, _ in points}) < 2:
        return None, None
    fit = fit_line([1.0] * len(points), [x for x, _ in points], [y for _, y in points])
    return fit.alpha_s, fit.beta_s_per_byte


def bench_fabric(path) -> float | None:
    """What the emulated links of the runs' machine carried at once, bytes/s, read off a
    bench.json that holds it (`fabric`, experiments/bench/fabric.py: psar bench's as root, psar
    compare predict's); None: it holds none."""
    import json
    from pathlib import Path

    try:
        carried = json.loads(Path(path).read_text()).get("fabric")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"cannot read bench report {path}: {err}") from None
    if carried is None:
        return None
    rate = carried.get("bytes_per_s") if isinstance(carried, dict) else None
    if not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"{path}: fabric.bytes_per_s={rate!r}, expected bytes/s > 0")
    return float(rate)


def calibration(run: Run, message: float | None = None, fabric: float | None = None,
                own_message: float | None = None) -> tuple[float, float, Timeline | None]:
    """(compute seconds, measured over played communication, its buckets' timeline) of one
    run, its messages' fixed cost set apart. A run that recorded when backward released its
    buckets (analysis/overlap.py) is played with them: the ratio is the one that gives its
    measured wait after backward. message, fabric, own_message: the run's Machine."""
    return _calibrate(run, _timeline(run), Machine(message, own_message, fabric))


def _calibrate(run: Run, line: Timeline | None, machine: Machine) -> tuple[float, float, Timeline | None]:
    """calibration on machine, played with the buckets of line (None: its exchange after
    backward, whole)."""
    compute = compute_time(run)
    target = _own_target(run, machine)
    nbytes, ps = float(gradient_bytes(run)), run.config.get("ps")
    step = _measured_step(run)
    period = step if run.label in ASYNC else None  # the pace its workers drifted at
    if line is not None:
        return compute, solve_ratio(lambda r: exposed_exchange(run.label, target, nbytes, ps, line, r, period),
                                    step - compute), line
    measured = step - compute - fixed_cost(run.label, target)
    played = exchange(run.label, target, nbytes, ps, period)
    return compute, (measured / played if played > 0 else 1.0), None


def exposed_exchange(label: str, target: Target, nbytes: float, ps: dict | None, line: Timeline,
                     ratio: float, period: float | None = None) -> float:
    """Seconds of label's exchange on the target left after backward, its buckets released as
    line says, every transfer `ratio` times its played time: an all-reduce's buckets one after
    the other (each with its messages' fixed cost); ZeRO stage 1 and 2's reduce-scatters so
    (half a ring each), then the all-gather of the whole; a parameter server's keys pipelined."""
    if label in ("zero-1", "zero-2"):  # each bucket's reduce-scatter (half a ring) in backward, the all-gathers after
        def half(share: float) -> float:
            return (exchange(label, target, share * nbytes) * ratio + fixed_cost(label, target)) / 2

        gathers = exchange(label, target, nbytes) * ratio / 2 + len(line.buckets) * fixed_cost(label, target) / 2
        return exposed(line, half) + gathers
    if family(label) == "ps":
        cluster = target.cluster("ps")
        slow = 1 / ratio if ratio > 0 else 1e12  # every link's transfers `ratio` times as long
        slowed = replace(cluster, rate=cluster.rate * slow, uplink=cluster.uplink * slow if cluster.uplink else None,
                         fabric=cluster.fabric * slow if cluster.fabric else None)
        return max(0.0, _ps_played(label, slowed, target, nbytes, ps, period, line.buckets) - line.backward_s)
    return exposed(line, lambda share: exchange(label, target, share * nbytes) * ratio + fixed_cost(label, target))


def _timeline(run: Run) -> Timeline | None:
    """The run's bucket timeline where its exchange is its gradient as backward makes it (the
    allreduce engine every step, ZeRO stages 1 and 2, a parameter server pipelined, each
    step), uncompressed; None otherwise."""
    ps = run.config.get("ps") or {}
    if run.engine == "zero" and int((run.config.get("zero") or {}).get("stage", 1)) < 3:
        return timeline(run)
    if run.compression or run.engine not in ("allreduce", "ps-sync", "ps-async", "ps-ssp") \
            or int((run.config.get("allreduce") or {}).get("period", 1)) > 1 or ps.get("exchange") == "phased" \
            or int(ps.get("push_every", 1)) > 1 or int(ps.get("fetch_every", 1)) > 1:
        return None
    return timeline(run)


def predict(runs: list[Run], labels: list[str], targets: list[Target], params_bytes: float | None = None,
            ran_on: Machine = Machine()) -> list[dict]:
    """One row per engine label and target: engine, workers, servers, step_s and its parts.
    params_bytes: a model of this many bytes of parameters in place of the runs' (model.
    params_mb): the exchange moves it, and the compute grows in proportion (a dense layer's
    forward and backward cost is proportional to its weights at a fixed batch).
    ran_on: the machines the runs ran on, whose messages' fixed cost is set apart from their
    exchange (by default allreduce/auto.py's LINK_MESSAGE_S) and whose fabric they were played
    on. Each label's messages cost what they do in its runs' collectives (Target.costed; a
    label without runs: the backend's)."""
    if not runs:
        raise ValueError("predict needs at least one run")
    if params_bytes is not None and params_bytes <= 0:
        raise ValueError(f"model.params_mb={params_bytes / 1e6:g}: must be > 0")
    measured_bytes = float(gradient_bytes(runs[0]))
    nbytes = params_bytes or measured_bytes
    grow = nbytes / measured_bytes
    by_label: dict[str, list[tuple[float, float, Timeline | None]]] = {}
    settings: dict[str, dict] = {}
    fan_in: dict[str, int] = {}  # label: the highest of its runs' shard_fan_in
    own: dict[str, bool] = {}  # label: whether its runs' collectives are psar's own
    waited: dict[str, float] = {}  # label: the largest share of a run's step it waited after backward
    lines = [_timeline(run) for run in runs]
    recorded = {}  # label: whether every run of it recorded its buckets (else all are played whole)
    for run, line in zip(runs, lines):
        recorded[run.label] = recorded.get(run.label, True) and line is not None
    for run, line in zip(runs, lines):
        by_label.setdefault(run.label, []).append(_calibrate(run, line if recorded[run.label] else None, ran_on))
        own[run.label] = own_collectives(run)
        step = _measured_step(run)
        waited[run.label] = max(waited.get(run.label, 0.0), (step - by_label[run.label][-1][0]) / step if step > 0 else 0.0)
        settings.setdefault(run.label, run.config.get("ps") or {})
        fan_in[run.label] = max(fan_in.get(run.label, 0), shard_fan_in(run.label, _own_target(run)))
    fallback = by_label[runs[0].label][0][0]
    batch = int(runs[0].config.get("batch_size") or 0)
    rows = []
    for label in labels:
        measured = by_label.get(label)
        compute = (median(c for c, _, _ in measured) if measured else fallback) * grow
        ratio = median(r for _, r, _ in measured) if measured else 1.0
        line = median_timeline([line for _, _, line in measured or ()]) if measured and recorded[label] else None
        if line is not None and grow != 1.0:  # backward grows with the compute
            line = Timeline(line.backward_s * grow, tuple((at * grow, share) for at, share in line.buckets))
        for target in (t.costed(own.get(label, False)) for t in targets):
            def comm_at(period: float | None) -> float:
                if line is not None:
                    return exposed_exchange(label, target, nbytes, settings.get(label), line, ratio, period)
                return exchange(label, target, nbytes, settings.get(label), period) * ratio + fixed_cost(label, target)

            comm = comm_at(None)
            if label in ASYNC and comm > 0:
                comm = drifting(compute, comm, comm_at)
            step = compute + comm
            rows.append({"engine": label, "workers": target.workers,
                         "servers": target.servers if family(label) == "ps" else None,
                         "step_s": step, "compute_s": compute, "comm_s": comm, "calibrated": bool(measured),
                         "samples_per_s": batch * target.workers / step if step > 0 and batch else None,
                         "efficiency": compute / step if step > 0 else 1.0, **link_bytes(label, target, nbytes),
                         "fan_in": shard_fan_in(label, target), "calibration_fan_in": fan_in.get(label),
                         "calibration_wait_share": waited.get(label)})
    for i in range(len(targets)):  # the fastest engine of each target (rows: label by label, target by target)
        here = rows[i::len(targets)]
        best = min(r["step_s"] for r in here)
        for r in here:
            r["fastest"] = r["step_s"] == best
    return rows


def drifting(compute: float, lockstep: float, comm_at: Callable[[float], float], tolerance: float = 1e-3) -> float:
    """The exchange of an async engine's step at its own pace: the period p with p = compute +
    comm_at(p), comm_at(p) the exchange of workers whose steps take p (the longer p, the less
    the others' load on every link and the shorter comm_at(p): one root), found by halving
    between the compute alone and its pace with the exchange in lockstep (`lockstep`), to
    `tolerance` of the period."""
    low, high = compute, compute + lockstep
    while compute + comm_at(high) > high:  # busier than in lockstep: a longer pace
        low, high = high, 2 * high
    while high - low > tolerance * high:
        mid = (low + high) / 2
        low, high = (mid, high) if compute + comm_at(mid) > mid else (low, mid)
    return (low + high) / 2 - compute


def shard_fan_in(label: str, target: Target) -> int:
    """How many hosts send into one shard's port at once in a parameter server's exchange:
    every worker where the shards have hosts of their own, the other workers where they share
    the workers'; 0 for the other engines. Where it is higher than the runs' own, their links
    may drop packets that the runs' never did (a drop-tail port overflowing), which the played
    links do not: see validate's retransmitted."""
    if family(label) != "ps":
        return 0
    return target.workers if target.placement == "separate" else target.workers - 1


def link_bytes(label: str, target: Target, nbytes: float) -> dict[str, float | None]:
    """Bytes a step moves over the busiest worker's link and the busiest separate shard's (its
    busier direction; None: no shard host), by the algorithm (analysis/linkmodel.phases)."""
    from .linkmodel import phases

    kind = family(label)
    separate = kind == "ps" and target.placement == "separate"
    steps = phases(label, target.workers, target.servers if kind == "ps" else 1, nbytes,
                   target.placement if kind == "ps" else "colocated")

    def busiest(prefix: str) -> float | None:
        hosts = {h for phase in steps for h in phase if h.startswith(prefix)}
        return max((max(sum(p[h][k] for p in steps if h in p) for k in (0, 1)) for h in hosts), default=None)

    return {"worker_link_bytes": busiest("w") or 0.0, "shard_link_bytes": busiest("s") if separate else None}


def _measured_step(run: Run) -> float:
    """A run's median step. Where no step waits for every worker (Run.asynchronous), the mean
    step: its steps are not alike, some waiting and some not, and what a schedule played in
    lockstep gives is their mean (the run's pace). Where the schedule repeats every k > 1
    steps (gossip on the one-peer exponential graph), the mean step over whole periods (the
    median of steps that alternate between a short and a long one is either), less the
    steps' consensus measurement (consensus_s, an all-reduce every gossip.consensus_every
    steps that the algorithm does not need)."""
    from allreduce.topology import period

    label, workers = run.label, int(run.summary["workers"])
    k = period(label.split("/", 1)[1], workers) if family(label) == "gossip" else 1
    records = run.steady_records()
    if k == 1:
        steps = [r["step_s"] - r.get("consensus_s", 0.0) for r in records]
        return sum(steps) / len(steps) if run.asynchronous else median(steps)
    by_step: dict[int, list[float]] = {}
    for r in records:
        by_step.setdefault(int(r["step"]), []).append(r["step_s"] - r.get("consensus_s", 0.0))
    steps = sorted(by_step)
    whole = steps[len(steps) % k:]  # whole periods, the last ones
    if not whole:
        raise ValueError(f"{run.path}: fewer steps than one period of its schedule ({k})")
    return sum(sum(by_step[s]) / len(by_step[s]) for s in whole) / len(whole)


def validate(runs: list[Run], link_bound: float = 0.5, message: float | None = None,
             fabric: float | None = None, own_message: float | None = None,
             shard: tuple[float | None, float | None] = (None, None)) -> list[dict]:
    """Each run with more workers than the fewest among the runs, predicted from those with
    the fewest alone (nothing is fitted on the rows checked): engine, its cluster, measured
    and predicted median step, the error, and whether it is link-bound (communication at
    least `link_bound` of its measured step); and the played exchange against the run's step
    less its own compute (exchange_error: the error with the compute's set apart, which on one
    machine grows with the workers that share its cores, where a cluster's would not); how busy
    its busiest links (links_busy) and its host's cores (host_cpu, analysis/hostcpu.py) were,
    and the cores its ranks and its shards held (ranks_cores, shards_cores).
    message: a message's fixed cost on the machines every run ran on (`psar bench`'s, see
    bench_message; None: the default); fabric: what their links carried at once, bytes/s,
    where one machine emulated them all (see experiments/bench/fabric.py; None: unlimited);
    own_message: a message's cost in psar's own collectives there (bench_message(own=True);
    None: message); shard: a shard's own seconds a message and a byte there (bench_shard;
    None: the defaults)."""
    if not runs:
        raise ValueError("validate needs runs")
    machine = Machine(message, own_message, fabric, *shard)
    fewest = min(int(r.summary["workers"]) for r in runs)
    calibration_runs = [r for r in runs if int(r.summary["workers"]) == fewest]
    held_out = [r for r in runs if int(r.summary["workers"]) > fewest]
    if not held_out:
        raise ValueError(f"every run has {fewest} workers: validate predicts runs with more workers from those")
    rows = []
    for run in held_out:
        target = _own_target(run, machine)
        [row] = predict(calibration_runs, [run.label], [target], ran_on=machine)
        measured = _measured_step(run)
        comm = median(r.get("comm_s", 0.0) for r in run.steady_records())
        waited = measured - compute_time(run)  # the run's exchange, less its own compute
        own = [r for r in calibration_runs if r.label == run.label]
        known = [x for x in map(retransmitted, own) if x is not None]
        tcp = sorted({c for c in map(congestion_of, own) if c})
        rows.append({**row, "run": str(run.path), "rate_bits": target.rate * 8, "racks": target.racks,
                     "latency_s": target.latency, "placement": target.placement if family(run.label) == "ps" else None,
                     "measured_s": measured, "error": row["step_s"] / measured - 1,
                     "measured_exchange_s": waited, "measured_compute_s": measured - waited,
                     "exchange_error": row["comm_s"] / waited - 1 if waited > 0 else None,
                     "link_bound": comm >= link_bound * measured, "retransmitted": retransmitted(run),
                     "calibration_retransmitted": max(known) if known else None,
                     "congestion": congestion_of(run), "calibration_congestion": ",".join(tcp) or None,
                     **_links_of(run), **_cores_of(run)})
    return rows


def _cores_of(run: Run) -> dict:
    """The share of the host's cores in use through the run's steps (host_cpu), how many it
    had (host_cores), and the cores its ranks and its shards held (ranks_cores, shards_cores;
    None where not counted): analysis/hostcpu.py."""
    found = host_cpu(run) or {}
    return {"host_cpu": found.get("used"), "host_cores": found.get("cores"), "ranks_cores": found.get("ranks"),
            "shards_cores": found.get("shards")}


def _links_of(run: Run) -> dict:
    """The run's busiest class of links and its share of a step (analysis/links.py; None
    without a links' timeline)."""
    from .links import busiest

    found = busiest(run)
    return {"busiest_links": found[0] if found else None, "links_busy": found[1] if found else None}


def congestion_of(run: Run) -> str | None:
    """The TCP congestion control its emulated hosts ran (summary.json's network.congestion);
    None: no emulated network, or a run from before it was recorded."""
    return (run.summary.get("network") or {}).get("congestion") or None


def retransmitted(run: Run) -> float | None:
    """The share of a run's TCP segments sent again (all hosts together): packets its links'
    queues dropped, which the played links never do. None: not recorded (loopback, or a run
    from before the counters)."""
    share = (run.summary.get("network") or {}).get("retransmitted")
    return float(share) if share is not None else None
