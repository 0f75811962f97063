"""`psar predict --map`: which engine wins, as psar predicts it, over worker counts and link
rates, with the measured runs overlaid; and each engine's scaling at one rate.

The left panel colours each cell (workers, rate) by the engine with the shortest predicted
step (analysis/predict.py), draws the boundaries between regions, and marks every run given
at its own workers and rate. The right panel is samples/s against workers at one rate, one
line per engine, with the runs measured at that rate as points.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from . import style
from .plots import save_figure
from .predict import Target, predict
from .results import Run

WORKERS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
RATES_BITS = (1e8, 2e8, 5e8, 1e9, 2.5e9, 1e10, 2.5e10, 1e11, 4e11)


def winners(runs: list[Run], labels: list[str], workers: tuple[int, ...], rates_bits: tuple[float, ...],
            like: Target, params_bytes: float | None = None) -> tuple[np.ndarray, dict]:
    """(index into labels of the fastest engine for each (rate, workers) cell, every row by
    (label, workers, rate_bits)); `like` gives the cluster's other settings."""
    targets = [Target(n, rate / 8, like.servers, like.placement, like.racks, like.uplink, like.latency, like.message)
               for rate in rates_bits for n in workers]
    rows = predict(runs, labels, targets, params_bytes)
    by = {(r["engine"], t.workers, round(t.rate * 8)): r  # predict's rows: label by label, target by target
          for r, t in zip(rows, [t for _ in labels for t in targets])}
    grid = np.array([[min(range(len(labels)), key=lambda i: by[labels[i], n, round(rate)]["step_s"])
                      for n in workers] for rate in rates_bits])
    return grid, by


def _edges(centres: tuple) -> np.ndarray:
    """Cell edges on a log axis: the geometric means of neighbouring centres, and half the
    first and twice the last."""
    c = np.array(centres, dtype=float)
    return np.sqrt(np.concatenate(([c[0] / 2], c)) * np.concatenate((c, [c[-1] * 2])))


def _measured(run: Run) -> tuple[int, float, float]:
    """(workers, rate bits/s, samples/s) of a run, from its median step (without a batch
    size: worker steps/s)."""
    steps = [r["step_s"] for r in run.steady_records()]
    batch = int(run.config.get("batch_size") or 0) or 1
    workers = int(run.summary["workers"])
    return workers, float(run.summary["network"]["rate_bits"]), batch * workers / median(steps)


def draw(runs: list[Run], labels: list[str], out: Path, like: Target, curve_rate_bits: float,
         workers: tuple[int, ...] = WORKERS, rates_bits: tuple[float, ...] = RATES_BITS,
         params_bytes: float | None = None) -> Path:
    """The map and the scaling curves, written to `out` (a .png); params_bytes: predict's."""
    rates = tuple(sorted(set(rates_bits) | {curve_rate_bits}))
    grid, by = winners(runs, labels, workers, rates, like, params_bytes)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    try:
        colours = [style.colour(label) for label in labels]
        x_edges, y_edges = _edges(workers), _edges(rates)
        left.pcolormesh(x_edges, y_edges, grid, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(labels) - 0.5,
                        alpha=0.55, edgecolors="none")
        for i in range(len(rates)):  # region boundaries: between cells whose winners differ
            for j in range(len(workers)):
                if j + 1 < len(workers) and grid[i, j] != grid[i, j + 1]:
                    left.plot([x_edges[j + 1]] * 2, [y_edges[i], y_edges[i + 1]], color="black", lw=1.2)
                if i + 1 < len(rates) and grid[i, j] != grid[i + 1, j]:
                    left.plot([x_edges[j], x_edges[j + 1]], [y_edges[i + 1]] * 2, color="black", lw=1.2)
        for label, c in zip(labels, colours):
            left.scatter([], [], marker="s", color=c, alpha=0.55, label=f"{label} fastest")
        shift = {label: 1.12 ** i for i, label in enumerate(dict.fromkeys(r.label for r in runs))}
        for run in runs:  # engines measured at one point side by side
            n, rate, _ = _measured(run)
            left.scatter([n * shift[run.label]], [rate], marker="o", s=40, color=style.colour(run.label),
                         edgecolors="black", zorder=3)
        left.scatter([], [], marker="o", color="white", edgecolors="black", label="measured run")
        left.set(xscale="log", yscale="log", xlabel="workers", ylabel="link rate (bit/s)",
                 title=f"fastest engine, predicted ({like.servers} shard{'s' * (like.servers > 1)}, {like.placement})")
        left.legend(fontsize="x-small", loc="center right", framealpha=0.9)
        for label, c in zip(labels, colours):
            rows = [by[label, n, round(curve_rate_bits)] for n in workers]
            points = [(r["workers"], r["samples_per_s"] or r["workers"] / r["step_s"]) for r in rows]
            right.plot(*zip(*points), color=c, marker=".", label=f"{label}, predicted")
        for run in runs:
            n, rate, samples = _measured(run)
            if abs(rate - curve_rate_bits) <= 0.01 * curve_rate_bits:
                right.scatter([n], [samples], color=style.colour(run.label), edgecolors="black", zorder=3,
                              label=f"{run.label} x{n}, measured")
        batch = all(r.config.get("batch_size") for r in runs)
        right.set(xscale="log", yscale="log", xlabel="workers", ylabel="samples/s" if batch else "worker steps/s",
                  title=f"scaling at {curve_rate_bits / 1e6:g} Mbit/s")
        right.grid(True, alpha=0.3)
        right.legend(fontsize="x-small")
        return save_figure(fig, out.parent, out.name)
    finally:
        plt.close(fig)
