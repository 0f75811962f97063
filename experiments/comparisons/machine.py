"""What `psar compare predict` measures of its machine before its training grid, written as
out/bench.json (its tables under the names `psar bench` gives them), from which the report
validates with the costs of the machine the grid runs on that day, not defaults:

- a message's fixed cost: `psar bench`'s 2-rank all-reduce table (about 30 s), read off as
  analysis/predict.py's bench_message does (the default: 250 us). On a 2-core machine one
  afternoon a table timed an hour after a grid fitted 857 us; timed just before the next
  grid, 349 us.
- what the emulated links carry at once (`fabric`, experiments/bench/fabric.py): four hosts
  at the grid's fastest rate, all to all over bare TCP. Without it the grid's 2gbit rows were
  predicted 22 to 30% short (docs/cost-model.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from experiments.bench.fabric import fabric_if_possible
from experiments.rundir import files


def measure(out: Path, echo: Callable[[str], None] = print) -> Path:
    """Time the all-reduce table and the fabric; write and return out/bench.json."""
    from experiments.bench.suite import allreduce_table

    out.mkdir(parents=True, exist_ok=True)
    echo("predict: a message's cost on this machine (psar bench's 2-rank all-reduce table)")
    report = {"allreduce_table": allreduce_table(2, out)}
    carried = fabric_if_possible(echo)
    if carried is not None:
        report["fabric"] = carried
    return files.write_json(out / "bench.json", report)
