"""Run a grid of engines x worker counts on one experiment; only the engine changes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .presets import build_config
from .engines import get_engine
from .launcher import LaunchError, launch


def run_grid(experiment: str, engines: list[str], workers: list[int], servers: list[int],
             out: Path, overrides=(), steps: int | None = None, seed: int | None = None,
             device: str | None = None, trace: bool | None = None,
             echo: Callable[[str], None] = print) -> tuple[list[Path], list[dict]]:
    """Launch every (engine, workers[, servers]) run into out/runs/.

    Returns the directories of the runs that finished, and one dict per run that failed
    (engine, workers, servers, error): a failed cell is reported, the grid goes on.
    """
    run_dirs, failures = [], []
    for engine_name in engines:
        for n in workers:
            for s in servers if get_engine(engine_name).uses_servers else [1]:
                cfg = build_config(experiment, overrides, engine=engine_name, workers=n, servers=s,
                                   steps=steps, seed=seed, device=device, trace=trace)
                tag = f"-s{s}" if get_engine(engine_name).uses_servers else ""
                run_dir = Path(out) / "runs" / f"{engine_name}-w{n}{tag}"
                shards = f", {s} server shard(s)" if tag else ""
                echo(f"running {experiment} with {engine_name} on {n} worker(s){shards} -> {run_dir}")
                try:
                    launch(cfg, run_dir)
                except LaunchError as err:
                    echo(f"  failed: {err}")
                    failures.append({"engine": engine_name, "workers": n,
                                     "servers": s if tag else "", "error": str(err)})
                    continue
                run_dirs.append(run_dir)
    return run_dirs, failures
