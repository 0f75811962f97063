"""The measurement of `psar compare predict` before its training grid: `psar bench`'s 2-rank
all-reduce table on this machine (about 30 s), written as out/bench.json. The report reads a
message's fixed cost off it (analysis/predict.py's bench_message) and validates with the cost
of the machine the grid runs on that day, not the default (250 us). On a 2-core machine one
afternoon a table timed an hour after a grid fitted 857 us, and with it that grid's 2gbit
all-reduce row went from -27.0% to +10.3%; timed just before the next grid, it fitted 349 us,
and that grid's 2gbit rows stayed 26 to 30% short (docs/cost-model.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from experiments.rundir import files


def measure(out: Path, echo: Callable[[str], None] = print) -> Path:
    """Time the all-reduce table; write and return out/bench.json (as `psar bench` writes it)."""
    from experiments.bench.suite import allreduce_table

    out.mkdir(parents=True, exist_ok=True)
    echo("predict: a message's cost on this machine (psar bench's 2-rank all-reduce table)")
    return files.write_json(out / "bench.json", {"allreduce_table": allreduce_table(2, out)})
