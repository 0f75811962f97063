"""The decentralized comparison: gossip (D-PSGD on a ring and on the one-peer exponential
graph, AD-PSGD on the ring) and DiLoCo beside the ring all-reduce and the parameter server, on a slow flat network,
on racks behind an oversubscribed uplink and with link latency: time to the target loss, what
each worker sends, the consensus distance of the gossip runs, and the link model's time.

Link theory (analysis/linkmodel.py), bandwidth only: a ring all-reduce sends 2(N-1)/N M per
worker a step (DiLoCo once every H steps), gossip degree x M in one hop (2M on a ring, M
one-peer; AD-PSGD M, one average a step), a parameter server M each way per worker; on racks (analysis/racks.py) the busiest
link's bytes, uplinks included. Latency is not in it: a message waits it once per hop, a ring
all-reduce 2(N-1) hops per bucket, a parameter server two a step (push, pull), gossip one a
step and behind the step's compute, since its exchange starts when the previous step ends.
"""

from __future__ import annotations

from pathlib import Path

from .plots import loss_over_time, panels  # first: analysis.style selects the Agg backend
from .linkmodel import run_link_time
from .results import Run, family, mean_step, median, time_to_target
from .style import colour
from .table import write_report
from .traffic import run_traffic

COLUMNS = [
    ("network", "network"), ("engine", "engine"), ("step_ms", "mean step ms"), ("theory_ms", "link theory ms"),
    ("sent_mb", "MB sent/worker/step"), ("time_to_target_s", "s to target"), ("steps_to_target", "steps to target"),
    ("final_loss", "final loss"), ("accuracy", "final accuracy"), ("consensus", "consensus distance"),
]


def network_of(run: Run) -> str:
    """The run's network in words: its rate, racks and uplink, latency."""
    net = run.summary.get("network") or {}
    config = run.config.get("net") or {}
    words = [net.get("rate") or config.get("rate") or "loopback"]
    if int(config.get("racks") or 1) > 1:
        words.append(f"{config['racks']} racks, {config.get('uplink') or 'full'} uplinks")
    if config.get("latency_ms"):
        words.append(f"{config['latency_ms']:g} ms")
    return ", ".join(words)


def name_of(run: Run) -> str:
    """The engine as the comparison names it: DiLoCo is local SGD with an outer step."""
    settings = run.config.get("allreduce") or {}
    if family(run.label) == "ring" and settings.get("outer", "none") != "none":
        return f"diloco every {settings.get('period', 1)}"
    if family(run.label) == "gossip" and run.asynchronous:
        return f"ad-psgd/{run.label.split('/', 1)[1]}"
    return run.label


def rows(runs: list[Run]) -> list[dict]:
    out = []
    for run in sorted(runs, key=lambda r: (network_of(r), name_of(r))):
        hit = time_to_target(run)
        link = run_link_time(run, run_traffic(run))
        sent = run.summary.get("sent_bytes_per_worker_per_step", 0)
        if link is not None:  # local SGD (DiLoCo): the parameters' all-reduce once a period
            link /= run.period
        if name_of(run).startswith("ad-psgd"):
            # one model each way a step per worker (an active's average; a passive serves as
            # many), not one per neighbour; a passive's averages after its last step are in no
            # record, so an active's records (rank 0) give the bytes
            from .linkmodel import gossip_degree

            link = None if link is None else link / gossip_degree(run.label, int(run.summary["workers"]))
            sent = median([r["bytes_sent"] for r in run.metrics.get(0, [])] or [0])
        accuracy = (run.summary.get("eval") or {}).get("accuracy")
        out.append({
            "network": network_of(run), "engine": name_of(run), "step_ms": 1e3 * mean_step(run),
            "theory_ms": None if link is None else 1e3 * link,
            "sent_mb": sent / 1e6,
            "time_to_target_s": hit[1] if hit else None, "steps_to_target": hit[0] if hit else None,
            "final_loss": run.summary.get("final_loss"),
            "accuracy": None if accuracy is None else f"{100 * accuracy:.1f}%",
            "consensus": run.summary.get("consensus_distance"),
        })
    return out


def consensus_over_steps(run: Run) -> tuple[list[int], list[float]]:
    """The consensus distances a gossip run measured (rank 0's records) and their steps."""
    points = [(r["step"], r["consensus_distance"]) for r in run.metrics.get(0, []) if "consensus_distance" in r]
    return [s for s, _ in points], [d for _, d in points]


def _by_network(runs: list[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(network_of(run), []).append(run)
    return out


def loss_vs_time(runs: list[Run], out_dir: Path) -> Path | None:
    """Training loss against time, a panel per network, a line per engine."""
    grouped = _by_network(runs)

    def draw(ax, network: str) -> None:
        for run in sorted(grouped[network], key=name_of):
            ax.plot(*loss_over_time(run), label=name_of(run), color=colour(run.label),
                    linestyle={"diloco": "--", "ad-psgd": ":"}.get(name_of(run).split(" ")[0].split("/")[0], "-"))

    return panels(sorted(grouped), draw, out_dir, "decentralized_loss_vs_time.png", "time (s)", "training loss")


def consensus(runs: list[Run], out_dir: Path) -> Path | None:
    """The gossip runs' consensus distance against the step, a panel per network."""
    gossip = [r for r in runs if family(r.label) == "gossip"]
    grouped = _by_network(gossip)

    def draw(ax, network: str) -> None:
        for run in sorted(grouped[network], key=name_of):
            ax.plot(*consensus_over_steps(run), marker="o", markersize=3, label=name_of(run), color=colour(run.label))

    return panels(sorted(grouped), draw, out_dir, "consensus_vs_step.png", "step", "consensus distance",
                  yscale="log")


def report(runs: list[Run], out_dir: Path) -> tuple[str, list[Path]]:
    """decentralized.md (and .csv) of rows(runs), and the two figures."""
    return write_report(rows(runs), out_dir, COLUMNS, "decentralized",
                        [loss_vs_time(runs, out_dir), consensus(runs, out_dir)])
