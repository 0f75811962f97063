"""The comparison table: one row per run, written as CSV and Markdown."""

from __future__ import annotations

import csv
from pathlib import Path

from experiments.engines import label_info

from .hostcpu import host_used
from .links import links_busy
from .results import Run, distinctions, median, quantile, time_to_target

COLUMNS = [
    ("engine", "engine"),
    ("workers", "workers"),
    ("servers", "servers"),
    ("runs", "runs"),
    ("samples_per_sec", "samples/s"),
    ("samples_per_sec_range", "samples/s range"),
    ("speedup", "speed-up vs 1 worker"),
    ("final_loss", "final loss"),
    ("steps_to_target", "steps to target"),
    ("time_to_target_s", "time to target (s)"),
    ("eval", "eval"),
    ("comm_share", "comm share of step"),
    ("mb_per_worker_step", "MB/worker/step"),
    ("step_s", "step (s)"),
    ("theory_step_s", "link theory (s)"),
    ("measured_over_theory", "measured/theory"),
    ("links_busy", "links busy"),
    ("host_cpu", "host cpu"),
    ("staleness_median", "staleness p50"),
    ("staleness_p99", "staleness p99"),
    ("collision_rate", "row collisions"),
    ("note", "note"),
]
"""Every column of summary.csv; summary.md leaves out those that are empty in every row
(runs and the range appear with --repeats, note where a figure needs one)."""

STATISTICS = {
    "samples_per_sec": "all workers' samples per second while every worker trained (step 0 left out); "
                       "median over the cell's runs",
    "samples_per_sec_range": "slowest to fastest of the cell's runs",
    "speedup": "samples/s over the 1-worker cell's",
    "final_loss": "mean training loss of the last 10% of steps over every worker, median over the runs",
    "steps_to_target": "first step at which the loss, averaged over workers and 5 steps, reached the "
                       "target; median over the runs that reached it",
    "comm_share": "communication time over step time, every rank and step after the first of every run",
    "mb_per_worker_step": "MB one worker sent plus received in a step, averaged over steps and workers, "
                          "mean over the runs",
    "step_s": "median over ranks and steps after the first (mean over whole periods where the engine "
              "communicates every H steps), median over the runs",
    "theory_step_s": "compute plus the link time of the step's bytes at the link's rate (once in H "
                     "steps under a period), median over the runs",
    "staleness_median": "over every push of the cell's runs",
    "links_busy": "an emulated host link's share of a step at its rate (median over the hosts' links, "
                  "each way, and the steps after the first; psar links), median over the runs",
    "host_cpu": "the share of the launching host's cores not idle during the steps after the first (at work, "
                "soft interrupts carrying emulated links included, or taken by a virtual machine's hypervisor; "
                "psar links), median over the runs: from 90%, the host's cores set the steps' pace as much as the "
                "links",
}
"""What each column is, for the lines under the table (legend)."""

OPTIONAL = ("runs", "samples_per_sec_range", "steps_to_target", "time_to_target_s", "step_s",
            "theory_step_s", "measured_over_theory", "links_busy", "host_cpu", "collision_rate", "note")

FEW_STEPS = 10
"""A throughput from fewer steady steps than this is marked in the note."""


def _staleness(run: Run) -> list[float]:
    values = []
    for record in run.records():
        value = record.get("staleness")
        if isinstance(value, list):
            values.extend(value)
        elif value is not None:
            values.append(value)
    return values


def _collision_rate(group: list[Run]) -> float | None:
    """Share of the rows pushed (by rows, async or ssp) that another worker had changed since
    the pushing worker read them: Hogwild!'s conflicts. None without row pushes."""
    stats = [s for run in group for s in run.summary.get("server_stats") or []
             if s.get("mode") in ("async", "ssp")]
    pushed = sum(s.get("rows_pushed", 0) for s in stats)
    return sum(s.get("row_collisions", 0) for s in stats) / pushed if pushed else None


def _eval_text(summary: dict) -> str:
    ev = summary.get("eval") or {}
    for key in ("auc", "accuracy", "bits_per_char", "loss"):
        if key in ev:
            return f"{key} {ev[key]:.4f}"
    return ""


def _notes(runs: list[Run]) -> str:
    """Why a figure of a cell is missing, or rests on little."""
    notes = []
    for run in runs:
        s = run.summary
        if s.get("samples_per_sec") is None:
            notes.append("no samples/s: the workers never trained at the same time past their first "
                         "step" if s["workers"] > 1 else "no samples/s: too few steps")
        elif (steady := len(run.metrics.get(0, [])) - 1) < FEW_STEPS:
            notes.append(f"samples/s from {max(steady, 0)} steps only")
    return "; ".join(dict.fromkeys(notes))


SUPERLINEAR = 1.1
"""A speed-up above this times the worker count is flagged: on a machine shared by the
workers it says the 1-worker run was slowed (more threads than cores, a busy machine)."""


def _speedup_note(speedup: float | None, workers: int) -> str:
    if speedup is None or speedup <= SUPERLINEAR * workers:
        return ""
    return (f"speed-up {speedup:.1f} above the {workers} workers: the 1-worker run was slow "
            f"(threads per worker, a busy machine), not this one fast")


def rate_of(run: Run) -> str:
    """The emulated links' rate a run had ("100mbit"), "" on loopback."""
    return (run.summary.get("network") or {}).get("rate", "")


def cell_of(run: Run, rated: bool = False) -> tuple:
    """The grid cell a run belongs to: repeats of one cell are summarised in one row. The
    name is the engine's label, with its compression ("allreduce/library +topk 0.01"). On an
    emulated network a ps-* run's servers say where the shards were: "2 separate", runs of
    one grid on links of several rates name theirs ("ps-sync +topk 0.01 @100mbit"), and a
    run with an injected fault says it ("ps-sync (rank 3 3x slower)")."""
    name = f"{run.label} +{run.compression}" if run.compression else run.label
    if run.period != 1 or run.engine == "ps-easgd":
        name += f" every {run.period}"
    if rated:
        name += f" @{rate_of(run) or 'loopback'}"
    if run.fault:
        name += f" ({run.fault})"
    if not run.spec.uses_servers:
        return name, run.summary["workers"], ""
    servers = run.summary.get("servers", 1)
    return name, run.summary["workers"], f"{servers} {run.placement}" if run.placement else servers


def cells(runs: list[Run]) -> dict:
    """{run.path: its cell} (see cell_of; runs on links of several rates name theirs), the
    name followed by "[key=value, ...]" where runs of one cell differ in a setting: a cell is
    one configuration, and the runs in it repeats. The table and the verdict name runs so."""
    rated = len({rate_of(r) for r in runs}) > 1
    base = {r.path: cell_of(r, rated) for r in runs}
    extra = distinctions(runs, lambda r: base[r.path])
    return {path: (f"{cell[0]} [{extra[path]}]" if extra[path] else cell[0], *cell[1:]) for path, cell in base.items()}


def failed_rows(failures: list[dict]) -> list[dict]:
    """Rows for grid cells whose run failed: the table shows them, with the error."""
    return [{key: None for key, _ in COLUMNS} | {"engine": f["engine"], "workers": f["workers"],
            "servers": f.get("servers", ""), "note": "failed: " + f["error"].splitlines()[0][:200]}
            for f in failures]


def rows(runs: list[Run]) -> list[dict]:
    """One row per grid cell (engine label, workers, servers). A cell run several times
    (--repeats) shows the median samples/s and final loss and the samples/s range; the
    other columns pool the records of its runs."""
    named = cells(runs)
    groups: dict[tuple, list[Run]] = {}
    for run in sorted(runs, key=lambda r: (*named[r.path][:2], str(named[r.path][2]))):
        groups.setdefault(named[run.path], []).append(run)
    rates = {cell: [r.summary["samples_per_sec"] for r in group if r.summary.get("samples_per_sec")]
             for cell, group in groups.items()}
    one_worker = {cell[0]: median(rates[cell]) for cell in groups if cell[1] == 1 and rates[cell]}
    out = []
    for cell, group in groups.items():
        label, workers, servers = cell
        records = [r for run in group for r in run.steady_records()]
        step_time = sum(r["step_s"] for r in records)
        staleness = [v for run in group for v in _staleness(run)]
        rate, base = median(rates[cell]), one_worker.get(label)
        speedup = rate / base if base and rate else None
        reached = [hit for run in group if (hit := time_to_target(run))]
        theory = _link_theory(group, _compute_elsewhere(runs, group[0]))
        target = group[0].config.get("target_loss") or 0.0
        out.append({
            "engine": label,
            "workers": workers,
            "servers": servers,
            "runs": len(group) if len(group) > 1 else None,
            "samples_per_sec": rate,
            "samples_per_sec_range": (f"{min(rates[cell]):.0f}-{max(rates[cell]):.0f}"
                                      if len(rates[cell]) > 1 else None),
            "speedup": speedup,
            "final_loss": median([r.summary["final_loss"] for r in group if r.summary["final_loss"] is not None]),
            "steps_to_target": (median([s for s, _ in reached]) if reached else
                                "not reached" if target else None),
            "time_to_target_s": median([t for _, t in reached]) if reached else None,
            "eval": _eval_text(group[0].summary),
            "comm_share": sum(r["comm_s"] for r in records) / step_time if step_time else None,
            "mb_per_worker_step": sum(r.summary["bytes_per_worker_per_step"] for r in group) / len(group) / 1e6,
            **theory,
            "links_busy": median([b for run in group if (b := links_busy(run)) is not None]),
            "host_cpu": median([b for run in group if (b := host_used(run)) is not None]),
            "staleness_median": median(staleness),
            "staleness_p99": quantile(staleness, 0.99),
            "collision_rate": _collision_rate(group),
            "note": "; ".join(n for n in (_notes(group), _speedup_note(speedup, workers)) if n) or None,
        })
    return out


def _link_theory(group: list[Run], compute_s: float | None = None) -> dict:
    """On an emulated network: the measured step, the step the link model predicts from the
    rate (compute + the busiest link's bytes at the rate) and their ratio; else nothing.
    compute_s: the compute to use instead of the runs' own (ddp's step_s - comm_s holds its
    communication, which runs inside backward: EngineSpec.comm_in_backward); None for such a
    group: no theory."""
    from .costmodel import compute_time, measured_step
    from .traffic import run_traffic
    from .linkmodel import run_link_time

    inside = group[0].spec.comm_in_backward
    if inside and compute_s is None:
        return {}
    pairs = []
    for run in group:
        if run.summary.get("network") and run.records():
            link = run_link_time(run, run_traffic(run))
            if link is not None:
                # under a period the link is paid once in run.period steps
                pairs.append((measured_step(run), (compute_s if inside else compute_time(run)) + link / run.period))
    if not pairs:
        return {}
    step, theory = median([m for m, _ in pairs]), median([t for _, t in pairs])
    return {"step_s": step, "theory_step_s": theory, "measured_over_theory": step / theory}


def _compute_elsewhere(runs: list[Run], run: Run) -> float | None:
    """For a run whose communication is inside backward (ddp): the compute of the dense
    all-reduce runs of the same experiment and worker count (same model, same batches,
    communication apart), None if there are none."""
    if not run.spec.comm_in_backward:
        return None
    from .costmodel import compute_time

    same = [compute_time(r) for r in runs if r.spec.family == "ring" and not r.spec.comm_in_backward
            and not label_info(r.label)[1].gathers_rows and r.summary["workers"] == run.summary["workers"] and r.records()
            and r.summary.get("experiment") == run.summary.get("experiment")]
    return median(same) if same else None



def _fmt(value, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _shown(table: list[dict], columns, optional) -> list[tuple[str, str]]:
    """The (key, title) of columns a table shows: the optional ones only where a row has a value."""
    return [(key, title) for key, title in columns
            if key not in optional or any(row.get(key) not in (None, "") for row in table)]


def markdown(table: list[dict], columns=None, optional=None, missing: str = "-") -> str:
    """The table in markdown: columns [(key, title)] (the comparison table's by default), the
    optional ones shown only where a row has a value; None printed as `missing`."""
    columns, optional = (COLUMNS, OPTIONAL) if columns is None else (columns, optional or ())
    shown = _shown(table, columns, optional)
    lines = ["| " + " | ".join(title for _, title in shown) + " |",
             "|" + "|".join("---" for _ in shown) + "|"]
    for row in table:
        lines.append("| " + " | ".join(_fmt(row.get(key), missing) for key, _ in shown) + " |")
    return "\n".join(lines) + "\n"


def write_columns(rows: list[dict], out_dir: Path, columns, name: str) -> tuple[str, Path, Path]:
    """name.csv and name.md of rows' columns alone, empty cells blank: (the markdown, the csv
    path, the md path). The named comparisons' own reports."""
    only = [{key: r.get(key) for key, _ in columns} for r in rows]
    text = markdown(only, columns, missing="")
    csv_path, md_path = write(only, out_dir, columns, name, text)
    return text, csv_path, md_path


def write_report(rows: list[dict], out_dir: Path, columns, name: str, figures) -> tuple[str, list[Path]]:
    """A named comparison's report: write_columns, and the figures made (None: not made);
    (the markdown, [md, csv, figures...])."""
    text, csv_path, md_path = write_columns(rows, out_dir, columns, name)
    return text, [md_path, csv_path, *(f for f in figures if f)]


def legend(table: list[dict]) -> str:
    """One line per column the comparison table shows that needs one: what statistic it is."""
    shown = dict(_shown(table, COLUMNS, OPTIONAL))
    return "".join(f"- {shown[key]}: {text}\n" for key, text in STATISTICS.items() if key in shown)


def write(table: list[dict], out_dir: Path, columns=None, name: str = "summary",
          text: str | None = None) -> tuple[Path, Path]:
    """name.csv and name.md in out_dir (the comparison table's columns by default; text: the
    markdown, if already made)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / f"{name}.csv", out_dir / f"{name}.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key for key, _ in columns or COLUMNS])
        writer.writeheader()
        writer.writerows(table)
    md_path.write_text(text if text is not None else markdown(table) + ("\n" + legend(table) if columns is None else ""))
    return csv_path, md_path
