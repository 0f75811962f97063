"""`psar bench`'s compression goals, on emulated links (root only): top-k at 1% with error
feedback against the uncompressed run of the same engine, and the cost model's crossover rate
against the one measured.

1. At 100mbit, mlp-mid 784-512-512-10 for STEPS steps, 2 workers: top-k 1% reaches the
   target loss at least 3x sooner than uncompressed on the same engine (allreduce, ps-sync),
   its final accuracy within one point.
2. ps-sync with top-k 1% moves at most 5% of the dense bytes per worker per step each way.
3. The predicted crossover (bytes saved over compression compute; the median of CALIBRATIONS
   predictions, each from a pair of runs at the slowest rate) within 25% of the measured one
   (step-time lines through the rates of CROSSOVER_RATES).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Callable

from analysis.compression import crossover_bracket, measured_crossover, predicted_crossover
from analysis.costmodel import measured_step
from analysis.results import load_run, time_to_target
from experiments.runtime.launcher import launch_batch
from experiments.settings.presets import build_config

MODEL = ("model.hidden=[512,512]",)
STEPS = 600
"""Long enough for both runs to converge: at 120 steps top-k 1% was 7.5 points of accuracy
behind on allreduce, at 400 3.1 behind, at 600 0.8 ahead (loopback, 2 workers)."""
TOPK = ("compress.method=topk", "compress.ratio=0.01")
CROSSOVER_RATES = ("250mbit", "500mbit", "1gbit", "2gbit", "4gbit")
"""Rates around both engines' crossovers: measured between the two where top-k stops paying
(analysis.compression.crossover_bracket). With 1gbit and 4gbit alone, ps-sync's crossover
(490 to 660 Mbit/s measured between rates around it, 2026-11-28) lay below both and its line
was extrapolated: 466 to 564 Mbit/s against 794 to 821 predicted."""
CROSSOVER_STEPS = 40
CALIBRATIONS = 3
"""The crossover is predicted from each of this many pairs of runs at the slowest rate, and
the median taken: from one pair, on this shared machine, three runs of each engine predicted
393, 1172 and 732 Mbit/s against 708, 1007 and 801 measured (the ring), 437, 224 and 531
against 380, 307 and 483 (ps-sync; 2026-11-29)."""


def _run(out: Path, name: str, engine: str, rate: str, steps: int, extra=()):
    servers = 2 if engine == "ps-sync" else 1
    cfg = build_config("mlp-mid", MODEL + (f"net.rate={rate}",) + tuple(extra), engine=engine, workers=2,
                       servers=servers, steps=steps)
    run_dir = out / name
    launch_batch([(cfg, run_dir)], quiet=True)
    return load_run(run_dir)


def _accuracy(run) -> float:
    return 100 * run.summary["eval"]["accuracy"]


def compression_goals(out: Path, echo: Callable[[str], None] = print) -> dict:
    if os.geteuid() != 0:
        echo("compression goals: skipped (emulated links need root)")
        return {}
    out = Path(out) / "compression"
    report: dict = {}
    echo("compression goals: mlp-mid 784-512-512-10, 2 workers, ps-sync with a shard per worker host")
    for engine in ("allreduce", "ps-sync"):
        dense = _run(out, f"{engine}-none", engine, "100mbit", STEPS)
        topk = _run(out, f"{engine}-topk", engine, "100mbit", STEPS, TOPK)
        hit_d, hit_t = time_to_target(dense), time_to_target(topk)
        sooner = hit_d[1] / hit_t[1] if hit_d and hit_t else None
        points = _accuracy(topk) - _accuracy(dense)
        report[engine] = {"sooner": sooner, "points": points, "time_to_target_s": [hit_d and hit_d[1], hit_t and hit_t[1]]}
        echo(f"  {engine} at 100mbit, {STEPS} steps: target loss in "
             f"{hit_d[1] if hit_d else float('nan'):.2f} s uncompressed, {hit_t[1] if hit_t else float('nan'):.2f} s "
             f"top-k 1% = {sooner or float('nan'):.2f}x sooner (goal >= 3); accuracy "
             f"{_accuracy(dense):.1f}% and {_accuracy(topk):.1f}% = {points:+.1f} points (goal within 1)")
        if engine == "ps-sync":
            for way in ("sent", "recv"):
                key = f"{way}_bytes_per_worker_per_step"
                ratio = topk.summary[key] / dense.summary[key]
                report[engine][f"{way}_ratio"] = ratio
                echo(f"  ps-sync top-k 1% {way}: {topk.summary[key]:.0f} of {dense.summary[key]:.0f} bytes per "
                     f"worker per step = {100 * ratio:.2f}% (goal <= 5%)")
    for engine in ("allreduce", "ps-sync"):
        report[f"{engine}_crossover"] = crossover_goal(out, engine, echo)
    return report


def crossover_goal(out: Path, engine: str, echo: Callable[[str], None] = print) -> dict:
    """Goal 3 for one engine: top-k 1% and uncompressed at every rate of CROSSOVER_RATES, the
    crossover predicted from the slowest rate's pairs and measured; its report."""
    base = {r: _run(out, f"{engine}-none-{r}", engine, r, CROSSOVER_STEPS) for r in CROSSOVER_RATES}
    topk = {r: _run(out, f"{engine}-topk-{r}", engine, r, CROSSOVER_STEPS, TOPK) for r in CROSSOVER_RATES}
    low = CROSSOVER_RATES[0]
    pairs = [(base[low], topk[low])] + [
        (_run(out, f"{engine}-none-{low}-{i}", engine, low, CROSSOVER_STEPS),
         _run(out, f"{engine}-topk-{low}-{i}", engine, low, CROSSOVER_STEPS, TOPK))
        for i in range(1, CALIBRATIONS)]
    each = [predicted_crossover(*pair) for pair in pairs]
    predicted = statistics.median(each) if all(each) else None
    measured = measured_crossover(base, topk)
    off = predicted / measured - 1 if predicted and measured else None
    bracket = crossover_bracket(base, topk)
    report = {"predicted_bits": predicted, "measured_bits": measured, "off": off, "predicted_each_bits": each,
              "between": bracket}
    steps = ", ".join(f"{r}: {1e3 * measured_step(base[r]):.1f} ms uncompressed, "
                      f"{1e3 * measured_step(topk[r]):.1f} ms top-k" for r in CROSSOVER_RATES)
    echo(f"  {engine} crossover of top-k 1%: predicted {predicted and predicted / 1e6 or float('nan'):.0f} "
         f"Mbit/s (median of {', '.join(f'{x / 1e6:.0f}' if x else 'none' for x in each)}), "
         f"measured {measured and measured / 1e6 or float('nan'):.0f} Mbit/s"
         + (f" = {100 * off:+.0f}% (goal within 25%)" if off is not None else "")
         + (f", between {bracket[0]} and {bracket[1]}" if bracket else "") + f" ({steps})")
    return report
