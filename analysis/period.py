"""The period comparison: how often a worker communicates (local SGD's H, Downpour's
push/fetch period, EASGD's tau) against what it costs in loss, per engine.

Cost model (the algorithm's): a worker that communicates once every H steps pays the
communication of an every-step run once in H steps. From the engine's period-1 run, compute
c (median step minus its communication) and communication m = t_1 - c, so t_H = c + m / H;
the table shows the prediction and its error against the measured mean step (the median
of a period of H would be a step without communication).
"""

from __future__ import annotations

from pathlib import Path

from .plots import loss_over_time, panels  # first: analysis.style selects the Agg backend
from .costmodel import compute_time
from .results import Run, mean_step, time_to_target
from .table import write_report

import matplotlib.pyplot as plt

COLUMNS = [
    ("engine", "engine"), ("period", "period"), ("kb_per_step", "KB/worker/step"), ("step_ms", "mean step ms"),
    ("predicted_ms", "predicted step ms"), ("error", "model error"), ("time_to_target_s", "s to target"),
    ("target_speedup", "speed-up to target"), ("final_loss", "final loss"), ("metric", "final metric"),
]


def _family(run: Run) -> str:
    """The engine a period is varied on (every ps-easgd run is one family, whatever tau)."""
    return run.label


def rows(runs: list[Run]) -> list[dict]:
    """One row per (engine, period), predicted from the engine's period-1 run (EASGD: its
    shortest tau) as communication divided by the period."""
    by: dict[str, dict[int, Run]] = {}
    for run in runs:
        by.setdefault(_family(run), {})[run.period] = run
    out = []
    for label, periods in sorted(by.items()):
        shortest = min(periods)
        base = periods[shortest]
        c, t1 = compute_time(base), mean_step(base)
        base_hit = time_to_target(base)
        for period in sorted(periods):
            run = periods[period]
            step = mean_step(run)
            predicted = c + (t1 - c) * shortest / period
            hit = time_to_target(run)
            accuracy = (run.summary.get("eval") or {}).get("accuracy")
            out.append({
                "engine": label, "period": period,
                "kb_per_step": run.summary.get("bytes_per_worker_per_step", 0) / 1e3,
                "step_ms": 1e3 * step, "predicted_ms": 1e3 * predicted,
                "error": f"{100 * (predicted / step - 1):+.0f}%".replace("-0%", "+0%") if period != shortest else "",
                "time_to_target_s": hit[1] if hit else None,
                "target_speedup": base_hit[1] / hit[1] if hit and base_hit else None,
                "final_loss": run.summary.get("final_loss"),
                "metric": None if accuracy is None else f"{100 * accuracy:.1f}%",
            })
    return out


def loss_vs_time(runs: list[Run], out_dir: Path) -> Path | None:
    """Training loss against time, a panel per engine, a line per period."""
    periods = sorted({r.period for r in runs})
    cmap = plt.get_cmap("viridis")

    def draw(ax, label: str) -> None:
        for run in sorted((r for r in runs if _family(r) == label), key=lambda r: r.period):
            ax.plot(*loss_over_time(run), label=f"every {run.period}",
                    color=cmap(periods.index(run.period) / max(1, len(periods) - 1) * 0.85))

    return panels(sorted({_family(r) for r in runs}), draw, out_dir, "period_loss_vs_time.png",
                  "time (s)", "training loss")


def report(runs: list[Run], out_dir: Path) -> tuple[str, list[Path]]:
    """period.md (and .csv) of rows(runs), and the figure."""
    return write_report(rows(runs), out_dir, COLUMNS, "period", [loss_vs_time(runs, out_dir)])
