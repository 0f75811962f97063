"""Run a grid of engines x worker counts on one experiment; only the engine changes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .presets import build_config
from .launcher import launch


def run_grid(experiment: str, engines: list[str], workers: list[int], out: Path,
             overrides=(), steps: int | None = None, seed: int | None = None,
             device: str | None = None, echo: Callable[[str], None] = print) -> list[Path]:
    """Launch every (engine, workers) run into out/runs/ENGINE-wN and return the run dirs."""
    run_dirs = []
    for engine_name in engines:
        for n in workers:
            cfg = build_config(experiment, overrides, engine=engine_name, workers=n, steps=steps,
                               seed=seed, device=device)
            run_dir = Path(out) / "runs" / f"{engine_name}-w{n}"
            echo(f"running {experiment} with {engine_name} on {n} worker(s) -> {run_dir}")
            launch(cfg, run_dir)
            run_dirs.append(run_dir)
    return run_dirs
