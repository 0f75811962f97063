"""`psar bench`'s all-reduce path goals, from one sweep of experiments/comparisons/collectives.py
on emulated links (root only):

1. On two racks behind a 4:1 oversubscribed uplink, hierarchical all-reduce takes at most 0.7x
   the ring's time (the ring in rank order, hosts placed in racks round-robin) from 16 MB.
2. allreduce.algorithm=auto takes at most 1.1x the fastest algorithm's time at every size
   and topology measured.
3. The alpha-beta model (allreduce/plancost.py) is within 15% of the measured time on the
   link-bound rows (where its link time is at least 80% of its whole).

(With 5 ms a message, halving-doubling or the tree at 64 KB on 8 ranks: suite.latency_table.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

from analysis.collectives import sweep_rows


def collectives_goals(out: Path, echo: Callable[[str], None] = print) -> dict:
    if os.geteuid() != 0:
        echo("collectives goals: skipped (emulated links need root)")
        return {}
    from experiments.comparisons.collectives import measure

    return goals(measure(Path(out) / "collectives", echo=echo), echo)


def goals(path: Path, echo: Callable[[str], None] = print) -> dict:
    """The goals read off a sweep's collectives.json (psar compare collectives writes one too)."""
    sweep = sweep_rows(json.loads(Path(path).read_text()))
    cells: dict[tuple, dict[str, dict]] = {}
    for r in sweep:
        cells.setdefault((r["topology"], r["bytes"]), {})[r["algorithm"]] = r
    report: dict = {"hierarchical_vs_ring": {}, "auto_vs_best": {}}
    for (topology, nbytes), algos in cells.items():
        key = f"{topology}, {algos['auto']['size']}"
        if "hierarchical" in algos and nbytes >= 16 << 20:
            ratio = algos["hierarchical"]["time_ms"] / algos["ring"]["time_ms"]
            report["hierarchical_vs_ring"][key] = ratio
            echo(f"  {key}: hierarchical {algos['hierarchical']['time_ms']:.1f} ms, ring "
                 f"{algos['ring']['time_ms']:.1f} ms = {ratio:.2f}x (goal <= 0.7)")
        report["auto_vs_best"][key] = algos["auto"]["vs_best"]
    worst = max(report["auto_vs_best"].items(), key=lambda kv: kv[1])
    echo(f"  auto against the fastest: worst {worst[1]:.2f}x ({worst[0]}) over {len(cells)} cells (goal <= 1.1)")
    bound = [r for r in sweep if r["link_bound"]]
    within = sum(abs(r["error"]) <= 0.15 for r in bound)
    off = max(bound, key=lambda r: abs(r["error"])) if bound else None
    report["model"] = {"link_bound_rows": len(bound), "within_15": within, "worst": off and off["error"]}
    if off:
        echo(f"  model on {len(bound)} link-bound rows: {within} within 15%, worst {off['error']:+.0%} "
             f"({off['algorithm']}, {off['topology']}, {off['size']}) (goal: all within 15%)")
    return report
