"""`psar bench`: measurements, not tests. Every figure is a ratio of two things timed in one run."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .launcher import launch_batch, run_ranks
from .metrics import read_metrics
from .presets import build_config

SKIP_STEPS = 3
"""Steps left out of each throughput figure (allocation, connection and cache warm-up)."""


def samples_per_sec(run_dir: Path, skip: int = SKIP_STEPS) -> float:
    per_rank = read_metrics(run_dir)
    rank0 = per_rank[0]
    span = rank0[-1]["time"] - rank0[skip - 1]["time"]
    samples = sum(r["samples"] for recs in per_rank.values() for r in recs[skip:])
    return samples / span


def engine_throughput(experiment: str, variants: dict[str, tuple[str, tuple[str, ...]]],
                      workers: int, steps: int, rounds: int, out: Path) -> dict[str, list[float]]:
    """samples/s of each variant (engine, overrides), rounds interleaved in one set of processes."""
    jobs, names = [], []
    for r in range(rounds):
        for name, (engine, overrides) in variants.items():
            cfg = build_config(experiment, overrides, engine=engine, workers=workers, steps=steps)
            jobs.append((cfg, out / f"{name}-round{r}"))
            names.append(name)
    launch_batch(jobs, quiet=True)
    result: dict[str, list[float]] = {name: [] for name in variants}
    for name, (_, run_dir) in zip(names, jobs):
        result[name].append(samples_per_sec(run_dir))
    return result


def allreduce_table(workers: int, out: Path) -> dict:
    path = out / "allreduce.json"
    run_ranks([sys.executable, "-m", "allreduce.benchmark", str(path)], workers, out / "logs-allreduce")
    return json.loads(path.read_text())


def format_allreduce_table(table: dict) -> str:
    lines = [f"all-reduce, {table['world']} ranks, {table['backend']} (float32, sum; median of 3)",
             f"{'size':>10} {'algorithm':>9} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
             f" {'ring/library busbw':>19}"]
    library = {r["bytes"]: r for r in table["rows"] if r["algorithm"] == "library"}
    for row in table["rows"]:
        ratio = row["busbw_gbs"] / library[row["bytes"]]["busbw_gbs"] if row["algorithm"] == "ring" else None
        lines.append(f"{_size(row['bytes']):>10} {row['algorithm']:>9} {row['time_us']:>10.1f} "
                     f"{row['algbw_gbs']:>12.3f} {row['busbw_gbs']:>12.3f} "
                     f"{'' if ratio is None else f'{ratio:.2f}x':>19}")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def run(echo: Callable[[str], None] = print, steps: int = 15, rounds: int = 3,
        workers: int = 2, out: Path | None = None) -> dict:
    out = Path(out or tempfile.mkdtemp(prefix="psar-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    echo(f"bench: results under {out}")
    table = allreduce_table(workers, out)
    echo(format_allreduce_table(table))
    echo("")
    variants = {"ddp": ("ddp", ()), "allreduce": ("allreduce", ()),
                "allreduce-ring": ("allreduce", ("allreduce.algorithm=ring",))}
    tput = engine_throughput("mlp-wide", variants, workers, steps, rounds, out)
    med = {name: statistics.median(v) for name, v in tput.items()}
    echo(f"mlp-wide, {workers} workers, batch 64/worker, {steps} steps x {rounds} interleaved rounds "
         f"(first {SKIP_STEPS} steps skipped), samples/s:")
    for name, values in tput.items():
        ratio = med[name] / med["ddp"]
        echo(f"  {name:15s} median {med[name]:8.1f}  rounds {', '.join(f'{v:.1f}' for v in values)}"
             f"  = {ratio:.3f}x ddp")
    report = {"allreduce_table": table, "throughput": tput, "median": med}
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    return report
