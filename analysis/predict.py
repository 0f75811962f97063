"""`psar predict`: measured runs carried to other worker counts and links.

For each engine, a step is its compute plus its exchange played over the target cluster's
links (analysis/schedules.py: every message a flow, links shared max-min fairly, racks behind
their uplinks, latency per hop). Both are read off the runs given: the compute is the
median of step_s - comm_s of the engine's runs (costmodel.compute_time); the model's bytes M
are model.pt's; and the exchange is scaled by the runs' own ratio of measured communication
to the same schedule played on the cluster they ran on (their rate, workers and shards), so
that what psar's implementation adds to the ideal (messages, copies, a shard's work) is
carried along rather than fitted anew. An engine with no run of its own takes the compute of
the runs' first engine and a ratio of 1 (the ideal).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from .costmodel import compute_time
from .results import Run, family
from .schedules import Cluster, gossip, parameter_server, ring_allreduce
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

    def cluster(self, engine_family: str) -> Cluster:
        separate = engine_family == "ps" and self.placement == "separate"
        return Cluster(self.workers, self.rate, self.servers if separate else 0, self.racks, self.uplink, self.latency)


def exchange(label: str, target: Target, nbytes: float) -> float:
    """Seconds of engine label's exchange of a step on the target cluster."""
    kind = family(label)
    cluster = target.cluster(kind)
    if kind == "local":
        return 0.0
    if kind == "ps":
        return parameter_server(cluster, nbytes, target.servers)
    if kind == "gossip":
        return gossip(cluster, nbytes, label.split("/", 1)[1])
    return ring_allreduce(cluster, nbytes) * (1.5 if label == "zero-3" else 1.0)


def _own_target(run: Run) -> Target:
    """The cluster a run ran on."""
    net = run.summary.get("network") or {}
    config = run.config.get("net") or {}
    rate = float(net.get("rate_bits") or 0) / 8
    if not rate:
        raise ValueError(f"{run.path} ran on loopback: predict needs runs on an emulated network (--net RATE)")
    return Target(int(run.summary["workers"]), rate, int(run.summary.get("servers") or 1),
                  config.get("placement", "colocated"), int(config.get("racks") or 1),
                  float(net["uplink_bits"]) / 8 if net.get("uplink_bits") else None,
                  float(config.get("latency_ms") or 0) / 1e3)


def calibration(run: Run) -> tuple[float, float]:
    """(compute seconds, measured over played communication) of one run."""
    compute = compute_time(run)
    measured = median(r["step_s"] for r in run.steady_records()) - compute
    played = exchange(run.label, _own_target(run), float(gradient_bytes(run)))
    return compute, (measured / played if played > 0 else 1.0)


def predict(runs: list[Run], labels: list[str], targets: list[Target]) -> list[dict]:
    """One row per engine label and target: engine, workers, servers, step_s and its parts."""
    if not runs:
        raise ValueError("predict needs at least one run")
    nbytes = float(gradient_bytes(runs[0]))
    by_label: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        by_label.setdefault(run.label, []).append(calibration(run))
    fallback = by_label[runs[0].label][0][0]
    batch = int(runs[0].config.get("batch_size") or 0)
    rows = []
    for label in labels:
        measured = by_label.get(label)
        compute = median(c for c, _ in measured) if measured else fallback
        ratio = median(r for _, r in measured) if measured else 1.0
        for target in targets:
            comm = exchange(label, target, nbytes) * ratio
            step = compute + comm
            rows.append({"engine": label, "workers": target.workers,
                         "servers": target.servers if family(label) == "ps" else None,
                         "step_s": step, "compute_s": compute, "comm_s": comm, "calibrated": bool(measured),
                         "samples_per_s": batch * target.workers / step if step > 0 and batch else None})
    return rows
