"""The collectives comparison's report: each all-reduce algorithm's time at each size on each
topology against the alpha-beta model (experiments/comparisons/collectives.py measured them),
where each wins, how close auto comes to the best; and the training grid on two racks beside
each run's link bound on the two-tier network."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .plots import save_figure  # first: analysis.style selects the Agg backend
from .costmodel import compute_time, measured_step
from .results import Run
from .table import markdown, write_columns

import matplotlib.pyplot as plt

LINK_BOUND = 0.8
"""A row is link-bound where the model's link time is at least this share of its whole, and
each rank's share of the tensor is above the links' burst (tbf lets a burst of 1 ms of the
rate through at once after an idle spell, experiments/runtime/netns.py's BURST_S: below it, a
message beats its link's rate)."""

SWEEP_COLUMNS = [("topology", "topology"), ("size", "size"), ("algorithm", "algorithm"), ("ran", "ran"),
                 ("time_ms", "time ms"), ("busbw_gbs", "busbw GB/s"), ("model_ms", "model ms"),
                 ("error", "measured/model - 1"), ("link_bound", "link-bound"), ("vs_best", "x best")]
WINNER_COLUMNS = [("topology", "topology"), ("size", "size"), ("best", "fastest"), ("best_ms", "ms"),
                  ("ring_x", "ring x best"), ("auto", "auto ran"), ("auto_x", "auto x best")]


def size_text(nbytes: int) -> str:
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes} B"


def sweep_rows(data: dict) -> list[dict]:
    """One row per (topology, size, algorithm) with its time against the model and the best
    (vs_best: the median over the rounds of its time over that round's fastest algorithm's,
    where the rounds were kept: a moment apart, both see the same load on a busy machine)."""
    cells: dict[tuple, list[dict]] = {}
    for r in data["rows"]:
        cells.setdefault((r["topology"], r["bytes"]), []).append(r)
    out = []
    for r in data["rows"]:
        others = [o for o in cells[(r["topology"], r["bytes"])] if o["algorithm"] != "auto"]  # auto runs one of them
        out.append({"topology": r["topology"], "size": size_text(r["bytes"]), "bytes": r["bytes"],
                    "algorithm": r["algorithm"], "ran": r["ran"], "time_ms": r["time_us"] / 1e3,
                    "busbw_gbs": r["busbw_gbs"], "model_ms": r["model_us"] / 1e3,
                    "error": r["time_us"] / r["model_us"] - 1,
                    "link_bound": "yes" if (r["model_link_us"] >= LINK_BOUND * r["model_us"]
                                            and r["bytes"] / r["ranks"] > r.get("burst_bytes", 0)) else "",
                    "vs_best": _vs_best(r, others)})
    return out


def _vs_best(row: dict, others: list[dict]) -> float:
    rounds = [o.get("rounds_us") for o in others]
    if row.get("rounds_us") and all(rounds) and len({len(x) for x in rounds + [row["rounds_us"]]}) == 1:
        return statistics.median(t / min(each) for t, each in zip(row["rounds_us"], zip(*rounds)))
    return row["time_us"] / min(o["time_us"] for o in others)


def winner_rows(sweep: list[dict]) -> list[dict]:
    """Per (topology, size): the fastest algorithm (auto aside), the ring's and auto's times
    against it."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in sweep:
        cells.setdefault((r["topology"], r["bytes"]), {})[r["algorithm"]] = r
    out = []
    for (topology, _), algos in cells.items():
        name, fastest = min(((a, r) for a, r in algos.items() if a != "auto"), key=lambda kv: kv[1]["time_ms"])
        auto, ring = algos.get("auto"), algos.get("ring")
        out.append({"topology": topology, "size": fastest["size"], "best": name, "best_ms": fastest["time_ms"],
                    "ring_x": ring["vs_best"] if ring else None,
                    "auto": auto["ran"] if auto else None, "auto_x": auto["vs_best"] if auto else None})
    return out


def model_error(sweep: list[dict]) -> str:
    """The model's error over the link-bound rows, per algorithm: the median and the worst."""
    lines = []
    for algo in dict.fromkeys(r["algorithm"] for r in sweep):
        errs = sorted(r["error"] for r in sweep if r["algorithm"] == algo and r["link_bound"])
        if errs:
            worst = max(errs, key=abs)
            lines.append(f"{algo}: {len(errs)} link-bound rows, median {errs[len(errs) // 2]:+.0%}, "
                         f"worst {worst:+.0%}, within 15%: {sum(abs(e) <= 0.15 for e in errs)}")
    return "\n".join(lines)


def figure(sweep: list[dict], out_dir: Path) -> Path:
    """Bus bandwidth against size, a panel per topology; the model dashed."""
    topologies = list(dict.fromkeys(r["topology"] for r in sweep))
    colours = {a: f"C{i}" for i, a in enumerate(dict.fromkeys(r["algorithm"] for r in sweep))}
    cols = 2 if len(topologies) == 4 else min(3, len(topologies))
    rows = -(-len(topologies) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, topo in zip(axes.flat, topologies):
        here = [r for r in sweep if r["topology"] == topo]
        for algo in dict.fromkeys(r["algorithm"] for r in here):
            pts = sorted((r["bytes"], r["busbw_gbs"], r["busbw_gbs"] * r["time_ms"] / r["model_ms"])
                         for r in here if r["algorithm"] == algo)
            colour = colours[algo]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colour, label=algo)
            if algo != "auto":
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=colour, alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(topo, fontsize=10)
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth GB/s")
    for ax in list(axes.flat)[len(topologies):]:
        ax.axis("off")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines() if not h.get_label().startswith("_")}
    axes.flat[0].legend(handles.values(), handles.keys(), fontsize=8)
    fig.suptitle("all-reduce algorithms: measured (solid) and the alpha-beta model (dashed)")
    path = save_figure(fig, out_dir, "collectives.png")
    plt.close(fig)
    return path


TRAIN_COLUMNS = [("label", "engine"), ("shards", "shards"), ("placement", "shards' racks"),
                 ("step_s", "median step s"), ("compute_s", "compute s"), ("uplink_mb", "MB over busiest uplink"),
                 ("ideal_s", "link ideal s"), ("vs_ideal", "measured/ideal")]


def train_rows(runs: list[Run]) -> list[dict]:
    """The training grid: each run's step against compute plus its busiest link's bytes (the
    two-tier network's ideal, analysis/racks.py)."""
    from .linkmodel import PAYLOAD
    from .racks import link_ideal

    out = []
    for run in runs:
        ideal = link_ideal(run, PAYLOAD)
        compute = compute_time(run)
        step = measured_step(run)
        out.append({"label": run.label, "shards": run.config.get("servers") if run.spec.family == "ps" else "",
                    "placement": run.shard_racks,
                    "step_s": step, "compute_s": compute,
                    "uplink_mb": ideal["uplink_bytes"] / 1e6 if ideal else None,
                    "ideal_s": compute + ideal["seconds"] if ideal else None,
                    "vs_ideal": step / (compute + ideal["seconds"]) if ideal else None})
    return out


def _write(rows: list[dict], out_dir: Path, columns, name: str) -> list[Path]:
    """name.csv and name.md of rows' columns."""
    return list(write_columns(rows, out_dir, columns, name)[1:])


def report(runs: list[Run], out_dir: Path) -> tuple[str, list[Path]]:
    """collectives.md (and the sweep's and winners' CSVs), the figure; the training grid's table."""
    out_dir = Path(out_dir)
    paths, parts = [], []
    data_path = out_dir / "collectives.json"
    if data_path.exists():
        sweep = sweep_rows(json.loads(data_path.read_text()))
        winners = winner_rows(sweep)
        parts += ["where each algorithm wins", markdown(winners, WINNER_COLUMNS, missing=""),
                  "model error on link-bound rows", model_error(sweep)]
        paths += _write(winners, out_dir, WINNER_COLUMNS, "collectives-winners")
        paths += _write(sweep, out_dir, SWEEP_COLUMNS, "collectives-sweep")
        paths.append(figure(sweep, out_dir))
    if runs:
        train = train_rows(runs)
        parts += ["training on two racks", markdown(train, TRAIN_COLUMNS, missing="")]
        paths += _write(train, out_dir, TRAIN_COLUMNS, "collectives-training")
    text = "\n\n".join(parts)
    (out_dir / "collectives.md").write_text(text + "\n")
    return text, [out_dir / "collectives.md"] + paths
