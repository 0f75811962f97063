"""The comparison table: one row per run, written as CSV and Markdown."""

from __future__ import annotations

import csv
from pathlib import Path

from .results import Run, median, quantile

COLUMNS = [
    ("engine", "engine"),
    ("workers", "workers"),
    ("servers", "servers"),
    ("samples_per_sec", "samples/s"),
    ("speedup", "speed-up vs 1 worker"),
    ("final_loss", "final loss"),
    ("eval", "eval"),
    ("comm_share", "comm share of step"),
    ("mb_per_worker_step", "MB/worker/step"),
    ("staleness_median", "staleness p50"),
    ("staleness_p99", "staleness p99"),
    ("note", "note"),
]


def _staleness(run: Run) -> list[float]:
    values = []
    for record in run.records():
        value = record.get("staleness")
        if isinstance(value, list):
            values.extend(value)
        elif value is not None:
            values.append(value)
    return values


def _eval_text(summary: dict) -> str:
    ev = summary.get("eval") or {}
    for key in ("accuracy", "bits_per_char", "loss"):
        if key in ev:
            return f"{key} {ev[key]:.4f}"
    return ""


def _note(run: Run) -> str:
    """Why a figure is missing, or rests on little."""
    s = run.summary
    if s.get("samples_per_sec") is None:
        return ("no samples/s: the workers never trained at the same time past their first step"
                if s["workers"] > 1 else "no samples/s: too few steps")
    return ""


def failed_rows(failures: list[dict]) -> list[dict]:
    """Rows for grid cells whose run failed: the table shows them, with the error."""
    return [{key: None for key, _ in COLUMNS} | {"engine": f["engine"], "workers": f["workers"],
            "servers": f.get("servers", ""), "note": "failed: " + f["error"].splitlines()[0][:200]}
            for f in failures]


def rows(runs: list[Run]) -> list[dict]:
    one_worker = {run.label: run.summary["samples_per_sec"] for run in runs
                  if run.summary["workers"] == 1 and run.summary.get("samples_per_sec")}
    out = []
    for run in sorted(runs, key=lambda r: (r.label, r.summary["workers"], r.summary.get("servers", 1))):
        s = run.summary
        records = [r for r in run.records() if r["step"] >= 1] or run.records()
        step_time = sum(r["step_s"] for r in records)
        staleness = _staleness(run)
        base = one_worker.get(run.label)
        out.append({
            "engine": run.label,
            "workers": s["workers"],
            "servers": s.get("servers", 1) if run.engine.startswith("ps-") else "",
            "samples_per_sec": s["samples_per_sec"],
            "speedup": s["samples_per_sec"] / base if base and s["samples_per_sec"] else None,
            "final_loss": s["final_loss"],
            "eval": _eval_text(s),
            "comm_share": sum(r["comm_s"] for r in records) / step_time if step_time else None,
            "mb_per_worker_step": s["bytes_per_worker_per_step"] / 1e6,
            "staleness_median": median(staleness),
            "staleness_p99": quantile(staleness, 0.99),
            "note": _note(run),
        })
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown(table: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in table:
        lines.append("| " + " | ".join(_fmt(row[key]) for key, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def write(table: list[dict], out_dir: Path) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "summary.csv", out_dir / "summary.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[key for key, _ in COLUMNS])
        writer.writeheader()
        writer.writerows(table)
    md_path.write_text(markdown(table))
    return csv_path, md_path
