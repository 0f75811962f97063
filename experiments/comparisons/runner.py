"""Run a grid of engines x worker counts on one experiment; only the engine changes."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from experiments.comparisons.grids import Variant
from experiments.settings.presets import build_config
from experiments.engines import get_engine
from experiments.runtime.launcher import LaunchError, launch_batch
from experiments.settings.script import script_config


def variants_of(engines: list[str], servers: list[int]) -> list[Variant]:
    """The plain grid: every engine, and each ps-* engine with every shard count."""
    return [Variant(e, s) for e in engines for s in (servers if get_engine(e).uses_servers else [1])]


def run_grid(experiment: str, variants: list[Variant], workers: list[int],
             out: Path, overrides=(), steps: int | None = None, seed: int | None = None,
             device: str | None = None, trace: bool | None = None,
             echo: Callable[[str], None] = print, repeats: int = 1,
             script: list[str] | None = None, max_restarts: int | None = None) -> tuple[list[Path], list[dict]]:
    """Launch every (variant, workers) run into out/runs/, `repeats` times: the whole grid
    once, then again, so that a noisy minute touches one run of each cell, not all of them
    (run directories get -r2, -r3, ... after the first).

    Returns the directories of the runs that finished, and one dict per run that failed
    (engine, workers, servers, error): a failed cell is reported, the grid goes on.
    script: [SCRIPT, ARGS...] a user's training script (experiments.api) in place of the
    experiment, which then only names it. max_restarts: every run's --max-restarts.
    """
    cells = []
    for variant in variants:
        with_servers = get_engine(variant.engine).uses_servers
        for n in variant.workers or workers:
            s = variant.shards(n)
            fields = dict(engine=variant.engine, workers=n, servers=s, seed=seed, device=device, trace=trace)
            if script:
                cfg = script_config(script[0], script[1:], tuple(overrides) + variant.overrides, **fields)
            else:
                cfg = build_config(experiment, tuple(overrides) + variant.overrides, steps=steps, **fields)
            where = f"-{cfg.net.placement}" if with_servers and cfg.net.rate else ""
            # Variants of one engine told apart by their settings' values: allreduce-w2-allgather,
            # ps-sync-w4-phased-s4-colocated (the placement is said after the shards)
            also = "".join(f"-{o.split('=', 1)[-1]}" for o in variant.overrides
                           if not (with_servers and o.startswith("net.placement=")))
            also = "".join(c if c.isalnum() or c in "-_." else "_" for c in also)
            cells.append((cfg, f"{variant.engine}-w{n}{also}" + (f"-s{s}{where}" if with_servers else ""),
                          f"{n} worker(s)" + (f", {s} server shard(s){where.replace('-', ' ')}"
                                              if with_servers else "")))
    run_dirs, failures = [], []
    # the workload as it runs: the experiment, with what the overrides change of its model and data
    workload = experiment + "".join(f" {o}" for o in overrides if o.startswith(("model.", "data.")))
    for repeat in range(1, repeats + 1):
        for cfg, name, shape in cells:
            run_dir = Path(out) / "runs" / (name + (f"-r{repeat}" if repeat > 1 else ""))
            echo(f"running {workload} with {cfg.engine} on {shape} -> {run_dir}")
            try:
                launch_batch([(cfg, run_dir)], script=script, max_restarts=max_restarts)
            except LaunchError as err:
                echo(f"  failed: {err}")
                failures.append({"engine": cfg.engine, "workers": cfg.workers,
                                 "servers": cfg.servers if get_engine(cfg.engine).uses_servers else "",
                                 "error": str(err)})
                continue
            run_dirs.append(run_dir)
    return run_dirs, failures
