"""The faults comparison: what a slow, stopped or dead worker costs each engine.

One row per (engine, fault), each against the same engine's run without a fault:

- steps/s: the model's steps per second from the end of step 0 to the end of the run, on
  the wall clock (the redone steps of a restart and the time it took are in it). A step is
  one update by every worker's gradient, or by the first N - b under backup workers; under
  ps-async and ps-ssp N pushes make one, counted while every worker was training (each
  runs its own steps, so a run's end is the slowest one's tail).
- predicted (straggler rows): the algorithm's, with the no-fault run's median step t0 and
  compute c, and the slow worker's median compute c' as it ran in the row's own run (its
  stall included; k*c where it has no records). A synchronous step waits for it,
  t0 + c' - c (the ring's: its communication starts with the last gradient; ps-sync's shard
  takes the others' pushes while the slow one computes, so it can beat this); with b >= 1
  backup workers it never waits; ps-async's other N-1 workers go on at 1/t0 and the slow one
  adds 1/(t0 + c' - c); ps-ssp's workers can be at most its bound ahead, so in the long run
  every one goes at the slow one's pace.
- steps lost and recovery: a restart's (summary.json: experiments/runtime/restarts.py).
- longest stall: the longest time the model went without a step (a pause, a restart).
"""

from __future__ import annotations

import json
from pathlib import Path

from .plots import panels  # first: analysis.style selects the Agg backend
from .results import Run, median, time_to_target
from .style import colour
from .table import write_report
from experiments.harness.inject import REFERENCE_STEPS


COLUMNS = [
    ("engine", "engine"), ("fault", "fault"), ("steps_per_s", "steps/s"), ("vs_none", "x no fault"),
    ("predicted", "predicted x"), ("time_to_target_s", "s to target"), ("steps_lost", "steps lost"),
    ("recovery_s", "recovery s"), ("stall_s", "longest stall s"), ("final_loss", "final loss"),
    ("metric", "final metric"),
]
NONE = "none"


def fault_of(run: Run) -> str:
    """The run's injected fault, in words ("none" without one)."""
    return run.fault or NONE


def _model_steps(run: Run) -> list[float]:
    """Wall times (since the run's start) at which the model took a step: rank 0's steps
    under a synchronous engine; under an asynchronous one every N-th push of all workers,
    while every worker was training (each runs its own steps: once a fast one is done, the
    rest is a slow one's tail)."""
    if run.spec.synchronous:
        return [run.since_start(r) for r in run.metrics.get(0, [])]
    ranks = [recs for recs in run.metrics.values() if recs]
    first, last = max(run.since_start(recs[0]) for recs in ranks), min(run.since_start(recs[-1]) for recs in ranks)
    walls = sorted(w for w in (run.since_start(r) for r in run.records()) if first <= w <= last)
    return walls[run.summary["workers"] - 1::run.summary["workers"]]


def steps_per_s(run: Run) -> float | None:
    walls = _model_steps(run)
    return (len(walls) - 1) / (walls[-1] - walls[0]) if len(walls) > 1 and walls[-1] > walls[0] else None


def longest_stall(run: Run) -> float | None:
    walls = _model_steps(run)
    return max((b - a for a, b in zip(walls, walls[1:])), default=None)


def predicted(run: Run, base: Run) -> float | None:
    """The straggler row's steps/s over the no-fault run's, by the algorithm (see above)."""
    fault = run.config.get("fault") or {}
    rank = fault.get("slow_rank", -1)
    steps = [r["step_s"] for r in base.metrics.get(0, []) if r["step"] >= 1]
    computes = [r["compute_s"] for r in base.steady_records()]
    if not steps or not computes or fault_of(run) == NONE or rank < 0:
        return None
    t0, c = median(steps), median(computes)
    # the slow worker's compute as it ran (its stall included), else k times the others'
    stalled = [r["compute_s"] for r in run.metrics.get(rank, []) if r["step"] > REFERENCE_STEPS]
    slow_c = median(stalled) if stalled else fault.get("slow_factor", 1.0) * c
    slow = t0 / (t0 + max(0.0, slow_c - c))
    if run.spec.synchronous:
        return 1.0 if (run.config.get("ps") or {}).get("backup_workers") else slow
    n = run.summary["workers"]
    return slow if run.spec.consistency == "ssp" else ((n - 1) + slow) / n


def rows(runs: list[Run]) -> list[dict]:
    """One row per run, in engine order, each scenario after the engine's no-fault run."""
    base = {run.label: run for run in runs if fault_of(run) == NONE}
    out = []
    for run in sorted(runs, key=lambda r: (r.label, fault_of(r) != NONE, fault_of(r))):
        rate, none = steps_per_s(run), base.get(run.label)
        none_rate = steps_per_s(none) if none is not None else None
        hit = time_to_target(run)
        accuracy = (run.summary.get("eval") or {}).get("accuracy")
        guess = predicted(run, none) if none is not None else None
        out.append({
            "engine": run.label, "fault": fault_of(run), "steps_per_s": rate,
            "vs_none": rate / none_rate if rate and none_rate else None,
            "predicted": guess, "time_to_target_s": hit[1] if hit else None,
            "steps_lost": run.summary.get("steps_lost"), "recovery_s": run.summary.get("recovery_s"),
            "stall_s": longest_stall(run), "final_loss": run.summary.get("final_loss"),
            "metric": None if accuracy is None else f"{100 * accuracy:.1f}%",
        })
    return out


def fault_window(run: Run) -> tuple[float, float] | None:
    """(start, end) in seconds since the run's start of its pause or kill (end: when the
    paused process went on, or the kill itself), from logs/fault-rank<r>.json."""
    started = run.started
    for path in sorted((run.path / "logs").glob("fault-rank*.json")) if started is not None else []:
        try:
            event = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        return event["wall"] - started, event.get("resumed", event["wall"]) - started
    return None


def loss_vs_time(runs: list[Run], out_dir: Path) -> Path | None:
    """Training loss (rank 0's, mean of 5 steps) against wall time, a panel per fault, a line
    per engine; where a kill or a stop struck, a dotted line in the engine's colour, and a
    dashed one where the stopped process went on."""

    def draw(ax, fault: str) -> None:
        for run in sorted((r for r in runs if fault_of(r) == fault), key=lambda r: r.label):
            recs = run.metrics.get(0, [])
            losses = [r["loss"] for r in recs]
            smooth = [sum(losses[max(0, i - 4): i + 1]) / len(losses[max(0, i - 4): i + 1])
                      for i in range(len(losses))]
            ax.plot([run.since_start(r) for r in recs], smooth, label=run.label, color=colour(run.label), lw=1.2)
            window = fault_window(run)
            if window is not None:
                ax.axvline(window[0], color=colour(run.label), ls=":", lw=1)
                if window[1] > window[0]:
                    ax.axvline(window[1], color=colour(run.label), ls="--", lw=0.8)

    faults = sorted({fault_of(r) for r in runs}, key=lambda f: (f != NONE, f))
    return panels(faults, draw, out_dir, "faults_loss_vs_time.png", "wall time (s)", "training loss (rank 0)",
                  width=4.4, yscale="log")


def report(runs: list[Run], out_dir: Path) -> tuple[str, list[Path]]:
    """faults.md (and .csv) of rows(runs), and the figure."""
    return write_report(rows(runs), out_dir, COLUMNS, "faults", [loss_vs_time(runs, out_dir)])
