"""Comparison figures: each function takes runs and an output folder, writes one PNG and
returns its path, or None when the runs give the figure nothing to show."""

from __future__ import annotations

from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from statistics import mean, median

from . import style  # first: selects the Agg backend before pyplot loads
from .results import Run

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator, NullLocator, ScalarFormatter

"""Engines whose ranks meet every step, so a fast rank waits for the slowest one."""

LINESTYLES = ("-", "--", ":", "-.")
HATCHES = ("", "..", "xx", "\\\\")
MARKERS = ("o", "s", "D", "^", "v")  # by server count: 1, 2, 3, ...


# -- shared set-up -----------------------------------------------------------------------

@contextmanager
def _figure(path: Path, title: str, xlabel: str, ylabel: str, runs: list[Run] = ()):
    """Yield the axes of a new figure; then label it (the title names the runs' network),
    add the legend, save it to `path` and close it (also when drawing failed, so no figure
    leaks)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    try:
        yield ax
        ax.set(title=title + _network(runs), xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=style.DPI)
    finally:
        plt.close(fig)


def _network(runs: list[Run]) -> str:
    """" on 200mbit links" for runs on an emulated network (the placements, when they differ
    from co-located); "" on loopback."""
    nets = {(n["rate"], n.get("placement", "colocated")) for run in runs if (n := run.summary.get("network"))}
    if not nets:
        return ""
    rates = sorted({rate for rate, _ in nets})
    separate = any(p == "separate" for _, p in nets)
    return f"\non {', '.join(rates)} links" + (" (some shards on hosts of their own)" if separate else "")


def _order(run: Run) -> tuple:
    """A run's grid cell, as the table's (runs of one cell are repeats)."""
    return run.label, run.summary["workers"], run.summary.get("servers", 1), run.placement or "", run.compression, run.period


def _variant(run: Run, runs: list[Run], named: dict | None = None) -> int:
    """Which of the runs that share run's label (and so its colour) this one is, so that a
    line style or hatch can tell them apart (runs that differ in a setting are apart too;
    named: style.names(runs, workers=True), where the caller has it)."""
    named = named if named is not None else style.names(runs, workers=True)
    shape = lambda r: (*_order(r), named[r.path])  # noqa: E731
    shapes = sorted({shape(r) for r in runs if r.label == run.label}, key=str)
    return shapes.index(shape(run))


def _line(run: Run, runs: list[Run]) -> dict:
    """Plot keywords of one run's line among `runs`: its label's colour, a line style per
    variant of that label, and widths that shrink down the list so that runs with identical
    losses (local, allreduce and ps-sync compute the same update) stay visible as outlines."""
    i, named = runs.index(run), style.names(runs, workers=True)
    return dict(color=style.colour(run.label), label=named[run.path],
                linestyle=LINESTYLES[_variant(run, runs, named) % len(LINESTYLES)],
                linewidth=3.0 - 2.0 * i / max(1, len(runs) - 1))


def _mean_loss(run: Run) -> dict[int, float]:
    """Training loss by step, averaged over ranks."""
    by_step = defaultdict(list)
    for record in run.records():
        by_step[record["step"]].append(record["loss"])
    return {step: mean(losses) for step, losses in sorted(by_step.items())}


def loss_over_time(run: Run) -> tuple[list[float], list[float]]:
    """(times, losses) by step: when every rank had finished the step, and its training loss
    averaged over the ranks."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for record in run.records():
        by_step[record["step"]].append(record)
    steps = [by_step[s] for s in sorted(by_step)]
    return [max(run.since_start(r) for r in rs) for rs in steps], [mean(r["loss"] for r in rs) for rs in steps]


def save_figure(fig, out_dir: Path, name: str) -> Path:
    """Lay out fig and write it to out_dir/name (the figure is left to the caller to close)."""
    fig.tight_layout()
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=style.DPI)
    return path


def panels(titles: list[str], draw, out_dir: Path, name: str, xlabel: str, ylabel: str,
           width: float = 4.2, yscale: str = "linear") -> Path | None:
    """A row of panels sharing the y axis, one per title, each drawn by draw(ax, title), with
    its labels, grid and legend; written to out_dir/name (None: no titles, no figure)."""
    if not titles:
        return None
    fig, axes = plt.subplots(1, len(titles), figsize=(width * len(titles), 3.6), squeeze=False, sharey=True)
    try:
        for ax, title in zip(axes[0], titles):
            draw(ax, title)
            ax.set(title=title, xlabel=xlabel, ylabel=ylabel, yscale=yscale)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="x-small")
        return save_figure(fig, out_dir, name)
    finally:
        plt.close(fig)


def _staleness(run: Run) -> list[int]:
    values = []
    for record in run.records():
        value = record.get("staleness")
        values.extend(value if isinstance(value, list) else [] if value is None else [value])
    return values


# -- the split of a step -----------------------------------------------------------------

def step_split(run: Run) -> dict[str, float]:
    """Mean seconds per step and rank (warm-up step left out) spent in compute (forward and
    backward), in communication not hidden by compute, and waiting for slower peers.

    Waiting of one record is its `wait_s` when the engine measured it (at most its comm_s: a
    pull sent during backward may be held from before the step). Otherwise, for a
    synchronous engine, it is estimated as how much longer the slowest rank computed in that
    step, capped by the record's comm_s; asynchronous engines and local do not wait.
    Communication is comm_s minus waiting. Raises ValueError for a run without records.
    """
    records = run.steady_records()
    if not records:
        raise ValueError(f"run {run.path} has no step records (metrics/rank*.jsonl)")
    slowest: dict[int, float] = {}
    for r in records:
        slowest[r["step"]] = max(slowest.get(r["step"], 0.0), r["compute_s"])
    synchronous = run.spec.synchronous and run.spec.processes_per_worker  # local: one process, no peers

    def waiting(r: dict) -> float:
        if "wait_s" in r:  # a shard's hold on a pull sent from a backward hook may begin before
            return min(r["wait_s"], r["comm_s"])  # the step: only what falls inside comm_s counts
        if not synchronous:
            return 0.0
        return min(r["comm_s"], slowest[r["step"]] - r["compute_s"])

    waits = [waiting(r) for r in records]
    return {
        "compute_s": mean(r["compute_s"] for r in records),
        # wait_s is part of comm_s; max() only keeps rounding from making a negative bar
        "comm_s": mean(max(0.0, r["comm_s"] - w) for r, w in zip(records, waits)),
        "wait_s": mean(waits),
    }


# -- the figures -------------------------------------------------------------------------

def loss_vs_step(runs: list[Run], out_dir: Path) -> Path | None:
    """Training loss (mean over ranks) against step, one line per run."""
    runs = sorted((r for r in runs if r.records()), key=_order)
    if not runs:
        return None
    path = Path(out_dir) / "loss_vs_step.png"
    with _figure(path, "Training loss by step", "step (optimizer updates)",
                 "training loss, mean over ranks (nats)", runs) as ax:
        for run in runs:
            loss = _mean_loss(run)
            ax.plot(list(loss), list(loss.values()), **_line(run, runs))
    return path


def loss_vs_time(runs: list[Run], out_dir: Path) -> Path | None:
    """Training loss (mean over ranks) against rank 0's seconds since its loop began."""
    runs = sorted((r for r in runs if r.metrics.get(0)), key=_order)
    if not runs:
        return None
    path = Path(out_dir) / "loss_vs_time.png"
    with _figure(path, "Training loss by wall-clock time", "wall-clock time, rank 0 (s)",
                 "training loss, mean over ranks (nats)", runs) as ax:
        for run in runs:
            loss = _mean_loss(run)
            rank0 = run.metrics[0]
            ax.plot([r["time"] for r in rank0], [loss[r["step"]] for r in rank0],
                    **_line(run, runs))
    return path


def throughput_vs_workers(runs: list[Run], out_dir: Path) -> Path | None:
    """Samples/s against workers, one line per engine label and server count, each with its
    ideal linear scaling from its smallest worker count (dashed, same colour); a point of
    several runs is their median, with a bar from the slowest to the fastest."""
    groups: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    first: dict[str, Run] = {}
    named = style.names(runs)
    for run in sorted(runs, key=_order):
        if run.summary.get("samples_per_sec"):
            name = named[run.path]
            groups[name][run.summary["workers"]].append(run.summary["samples_per_sec"])
            first.setdefault(name, run)
    if not groups:
        return None
    path = Path(out_dir) / "throughput_vs_workers.png"
    with _figure(path, "Throughput against workers", "workers (log2 scale)",
                 "throughput, all workers (samples/s)", runs) as ax:
        for name, by_workers in groups.items():
            run, workers = first[name], sorted(by_workers)
            throughput = [median(by_workers[n]) for n in workers]
            colour = style.colour(run.label)
            marker = MARKERS[(run.summary.get("servers", 1) - 1) % len(MARKERS)]
            ax.plot(workers, throughput, color=colour, marker=marker, label=name)
            if any(len(by_workers[n]) > 1 for n in workers):
                spread = [[t - min(by_workers[n]) for n, t in zip(workers, throughput)],
                          [max(by_workers[n]) - t for n, t in zip(workers, throughput)]]
                ax.errorbar(workers, throughput, yerr=spread, fmt="none", ecolor=colour, capsize=4)
            if len(workers) > 1:
                ax.plot(workers, [throughput[0] * n / workers[0] for n in workers],
                        color=colour, linestyle="--", linewidth=1)
        if any(len(by_workers) > 1 for by_workers in groups.values()):  # a line was drawn
            ax.plot([], [], color="black", linestyle="--", linewidth=1,
                    label="ideal: linear from fewest workers")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({n for g in groups.values() for n in g}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
    return path


def step_breakdown(runs: list[Run], out_dir: Path) -> Path | None:
    """A stacked bar per run of the mean step: compute, communication, waiting (step_split),
    its total written on top; tick labels take the run's engine colour. ddp's communication
    runs inside its backward, so its bar is all compute: a footnote on the figure says so."""
    runs = sorted((r for r in runs if r.records()), key=_order)
    if not runs:
        return None
    splits = [step_split(run) for run in runs]
    path = Path(out_dir) / "step_breakdown.png"
    with _figure(path, "Where a step's time goes (warm-up step left out)",
                 "run (engine label x workers)", "mean time per step and rank (ms)", runs) as ax:
        x = range(len(runs))
        bottom = [0.0] * len(runs)
        for part, key in (("compute", "compute_s"), ("communication", "comm_s"),
                          ("waiting", "wait_s")):
            heights = [1e3 * split[key] for split in splits]
            bars = ax.bar(x, heights, 0.6, bottom=bottom, label=part, **style.COMPONENTS[part])
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.bar_label(bars, labels=[f"{t:.3g}" if t < 1000 else f"{t:.0f}" for t in bottom],
                     fontsize="x-small", padding=2)
        ax.set_ylim(0, 1.12 * max(bottom, default=1.0) or 1.0)  # room for the totals
        inside = sorted({run.engine for run in runs if run.spec.comm_in_backward})
        named = style.names(runs, workers=True)
        ax.set_xticks(x, [named[run.path] + ("*" if run.spec.comm_in_backward else "")
                          for run in runs], rotation=30, ha="right")
        for tick, run in zip(ax.get_xticklabels(), runs):
            tick.set_color(style.colour(run.label))
        if inside:
            ax.figure.text(0.01, 0.01, f"* {', '.join(inside)} communicate{'s' if len(inside) == 1 else ''} "
                           "inside backward: its time counts as compute", fontsize="x-small", color="#4d4d4d")
    return path


def staleness_histogram(runs: list[Run], out_dir: Path) -> Path | None:
    """Fraction of pushes by staleness, grouped bars, one series per asynchronous run."""
    series = [(run, Counter(values)) for run in sorted(runs, key=_order)
              if not run.spec.synchronous and (values := _staleness(run))]
    if not series:
        return None
    shown = [run for run, _ in series]
    named = style.names(shown, workers=True)
    values = sorted({v for _, counts in series for v in counts})
    width = 0.8 / len(series)
    path = Path(out_dir) / "staleness_histogram.png"
    with _figure(path, "Staleness of pushes", "staleness (server versions)",
                 "fraction of pushes", runs) as ax:
        for i, (run, counts) in enumerate(series):
            total = sum(counts.values())
            offset = (i - (len(series) - 1) / 2) * width
            ax.bar([v + offset for v in values], [counts[v] / total for v in values], width,
                   color=style.colour(run.label), edgecolor="black", linewidth=0.5,
                   hatch=HATCHES[_variant(run, shown, named) % len(HATCHES)],
                   label=named[run.path])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return path


def links_through_a_step(runs: list[Run], out_dir: Path) -> Path | None:
    """For each run on an emulated network with a links' timeline (analysis/links.py), the
    share of its host links' rate they carried in each tenth of a step (mean over the links,
    both ways, and the steps): a line per run, where the link waits shows as a dip. Runs read
    more coarsely than a tenth of their step are left out."""
    from .links import TENTHS, busy, is_uplink

    shown = []
    for run in sorted(runs, key=_order):
        found = busy(run)
        if found is None or not found["fine"]:
            continue
        hosts = [t for link, t in found["tenths"].items() if not is_uplink(link)]
        if hosts:
            shown.append((run, [mean(t[k] for t in hosts) for k in range(TENTHS)]))
    if not shown:
        return None
    runs = [run for run, _ in shown]
    path = Path(out_dir) / "links_through_a_step.png"
    with _figure(path, "When in a step the links carry (steps after the first)",
                 "% of a step (from one step end to the next; a point a tenth)",
                 "share of a host link's rate (mean over links, both ways)", runs) as ax:
        x = [10 * k + 5 for k in range(TENTHS)]
        for run, tenths in shown:
            ax.plot(x, [100 * t for t in tenths], marker="o", markersize=3, **_line(run, runs))
        ax.set_xlim(0, 100)
        ax.set_ylim(0, 105)
    return path


FIGURES = (loss_vs_step, loss_vs_time, throughput_vs_workers, step_breakdown, staleness_histogram,
           links_through_a_step)


def plot_all(runs: list[Run], out_dir: Path) -> list[Path]:
    """Write every figure the runs have content for; return their paths. Of a cell run several
    times (--repeats), throughput shows every run (median and range); the other figures its
    first run."""
    first: dict[tuple, Run] = {}
    for run in runs:
        first.setdefault(_order(run), run)
    one_each = list(first.values())
    return [path for figure in FIGURES
            if (path := figure(runs if figure is throughput_vs_workers else one_each, out_dir)) is not None]
