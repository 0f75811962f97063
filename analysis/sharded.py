"""The sharded comparison: memory per worker against time per step, ZeRO's stages beside the
ring and the parameter server, each measured figure beside the formula it should meet.

Formula (Rajbhandari et al., SC'20, with Psi the model's bytes and K the optimizer's state
per byte of parameters: 2 for Adam and AdamW, 1 for SGD with momentum and Adagrad, 0 for
plain SGD): a replica (ddp, allreduce) holds Psi of parameters, Psi of gradients and K*Psi of
optimizer state; zero-1 K*Psi/N of state; zero-2 also Psi/N of gradients; zero-3 also Psi/N
of parameters (besides the units gathered at once, which the formula leaves out, as it does
the communication buffers). A parameter-server worker holds Psi and Psi and no state; its S
shards K*Psi/S each (co-located: on the workers' hosts). Each rank's optimizer step counters
(a float per parameter tensor) are left out of the formula.
"""

from __future__ import annotations

from pathlib import Path

from .plots import save_figure  # first: analysis.style selects the Agg backend
from .linkmodel import run_link_time
from .results import Run, family, mean_step, time_to_target
from .style import colour
from .table import write_report
from .traffic import gradient_bytes, run_traffic

import matplotlib.pyplot as plt

COLUMNS = [
    ("engine", "engine"), ("workers", "workers"), ("step_ms", "mean step ms"), ("theory_ms", "link theory ms"),
    ("mb_per_step", "MB/worker/step"), ("params_mb", "params MB"), ("grads_mb", "grads MB"),
    ("optimizer_mb", "optimizer MB"), ("comm_mb", "comm buffers MB"), ("formula_mb", "formula MB"),
    ("measured_mb", "measured MB"), ("shard_mb", "shard MB"), ("time_to_target_s", "s to target"),
    ("final_loss", "final loss"),
]
STATE = {"adam": 2, "adamw": 2, "adagrad": 1}


def state_per_byte(config: dict) -> int:
    """K: optimizer state bytes per parameter byte of the run's optimizer."""
    optim = config.get("optim") or {}
    name = optim.get("name", "sgd")
    return STATE.get(name, 1 if optim.get("momentum") else 0)


def formula(run: Run) -> dict[str, float]:
    """The paper's bytes per worker of the run: params, grads, optimizer."""
    psi, n, k = float(gradient_bytes(run)), int(run.summary["workers"]), state_per_byte(run.config)
    kind, label = family(run.label), run.label
    if kind == "sharded":
        stage = int(label.rsplit("-", 1)[1])
        return {"params": psi / n if stage == 3 else psi, "grads": psi / n if stage >= 2 else psi,
                "optimizer": k * psi / n}
    if kind == "ps":
        return {"params": psi, "grads": psi, "optimizer": 0.0}
    return {"params": psi, "grads": psi, "optimizer": k * psi}


def _colocated(run: Run) -> bool:
    """Its shards share the workers' hosts (ps-* with net.placement=colocated)."""
    return family(run.label) == "ps" and (run.config.get("net") or {}).get("placement", "colocated") == "colocated"


def rows(runs: list[Run]) -> list[dict]:
    out = []
    for run in sorted(runs, key=lambda r: (r.label, int(r.summary["workers"]))):
        memory = run.summary.get("memory_bytes_per_worker") or {}
        shard = run.summary.get("memory_bytes_per_shard") or {}
        expected = formula(run)
        link = run_link_time(run, run_traffic(run))
        hit = time_to_target(run)
        out.append({
            "engine": run.label, "workers": int(run.summary["workers"]), "step_ms": 1e3 * mean_step(run),
            "theory_ms": None if link is None else 1e3 * link,
            "mb_per_step": run.summary.get("bytes_per_worker_per_step", 0) / 1e6,
            **{f"{key}_mb": memory.get(key, 0) / 1e6 for key in ("params", "grads", "optimizer")},
            "comm_mb": memory.get("comm_buffers", 0) / 1e6,
            "formula_mb": sum(expected.values()) / 1e6,
            "measured_mb": sum(memory.get(key, 0) for key in expected) / 1e6,
            "shard_mb": sum(shard.values()) / 1e6 if shard else None,
            "host_mb": (sum(memory.values()) + (sum(shard.values()) if _colocated(run) else 0)) / 1e6,
            "time_to_target_s": hit[1] if hit else None, "final_loss": run.summary.get("final_loss"),
        })
    return out


def memory_vs_step(table: list[dict], out_dir: Path) -> Path | None:
    """Memory per worker's host (parameters, gradients, optimizer state and communication
    buffers; with co-located shards, the host's shard too) against the mean step, one point
    per engine and worker count."""
    if not table:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        _points(ax, table)
        return save_figure(fig, out_dir, "memory_vs_step.png")
    finally:
        plt.close(fig)


def _points(ax, table: list[dict]) -> None:
    for row in table:
        held = row["host_mb"]
        ax.scatter(row["step_ms"], held, color=colour(row["engine"]), s=30 + 15 * row["workers"],
                   label=row["engine"] if row["workers"] == min(r["workers"] for r in table
                                                               if r["engine"] == row["engine"]) else None)
        ax.annotate(f"x{row['workers']}", (row["step_ms"], held), textcoords="offset points", xytext=(5, 3),
                    fontsize=8)
    ax.set(xlabel="mean step (ms)", ylabel="MB per worker's host (with its shard)",
           title="memory against time per step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def report(runs: list[Run], out_dir: Path) -> tuple[str, list[Path]]:
    """sharded.md (and .csv) of rows(runs), and the figure."""
    table = rows(runs)
    return write_report(table, out_dir, COLUMNS, "sharded", [memory_vs_step(table, out_dir)])


SCALES = (1, 2, 8, 64, 256, 1024)
SETTINGS = ("replicated", "zero-1", "zero-2", "zero-3", "ps worker")


def bytes_per_worker(setting: str, psi: float, k: int, n: int) -> float:
    """The paper's bytes per worker (parameters, gradients and optimizer state) of setting
    (a replica: ddp, allreduce; a ZeRO stage; a parameter server's worker) on n workers."""
    return {"replicated": (2 + k) * psi, "zero-1": 2 * psi + k * psi / n, "zero-2": psi + (1 + k) * psi / n,
            "zero-3": (2 + k) * psi / n, "ps worker": 2 * psi}[setting]


def format_memory(runs: list[Run]) -> str:
    """`psar model`'s memory table: the formula at N = 1 to 1024 for the runs' model and
    optimizer, then each run's measured bytes beside its formula."""
    base = runs[0]
    psi, k = float(gradient_bytes(base)), state_per_byte(base.config)
    lines = [f"memory per worker, the ZeRO paper's formula (M = {psi / 1e6:.2f} MB, optimizer state "
             f"{k} bytes per parameter byte), MB:",
             f"{'setting':<12}" + "".join(f"{f'N={n}':>10}" for n in SCALES)]
    for setting in SETTINGS:
        lines.append(f"{setting:<12}" + "".join(f"{bytes_per_worker(setting, psi, k, n) / 1e6:>10.3g}" for n in SCALES))
    measured = [r for r in runs if r.summary.get("memory_bytes_per_worker")]
    if measured:
        lines.append("measured (params + grads + optimizer, without communication buffers), MB:")
    for run in measured:
        memory, expected = run.summary["memory_bytes_per_worker"], formula(run)
        held = sum(memory.get(key, 0) for key in expected)
        lines.append(f"  {run.label} x{run.summary['workers']}: {held / 1e6:.3g} (formula "
                     f"{sum(expected.values()) / 1e6:.3g}; comm buffers {memory.get('comm_buffers', 0) / 1e6:.3g})")
    return "\n".join(lines)
