"""How much of a short run is start-up: `psar run quickstart --steps 5` (a few ms of training)
against `python -c "import torch"`, timed in the same rounds, as a ratio."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("local", "allreduce", "ps-sync")
STEPS = 5


def _wall(argv: list[str], log: Path) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, check=True, timeout=300)
    return time.perf_counter() - start


def startup(rounds: int, workers: int, out: Path) -> dict:
    """Per engine, each round's wall time of the short run over that round's torch import."""
    ratios: dict[str, list[float]] = {name: [] for name in ENGINES}
    imports = []
    for r in range(rounds):
        imports.append(_wall([sys.executable, "-c", "import torch"], out / f"startup-import-{r}.log"))
        for engine in ENGINES:
            run = [sys.executable, "-m", "experiments.cli", "run", "quickstart", "--engine", engine,
                   "--workers", str(workers), "--steps", str(STEPS), "--out", str(out / f"startup-{engine}-{r}"),
                   "--overwrite"]  # an earlier bench's run is replaced
            ratios[engine].append(_wall(run, out / f"startup-{engine}-{r}.log") / imports[-1])
    return {"import_torch_s": imports, "ratio": ratios}


def format_startup(result: dict, workers: int) -> str:
    lines = [f"start-up: psar run quickstart --steps {STEPS} --workers {workers}, wall time over "
             f"`python -c \"import torch\"` ({', '.join(f'{s:.2f}' for s in result['import_torch_s'])} s) "
             f"in the same round:"]
    for engine, values in result["ratio"].items():
        lines.append(f"  {engine:10s} median {statistics.median(values):.2f}x  "
                     f"rounds {', '.join(f'{v:.2f}' for v in values)}")
    return "\n".join(lines)
