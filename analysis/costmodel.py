"""An alpha-beta cost model of one training step, fitted to `psar bench` and checked on runs.

Inputs are files only: a bench report (`bench.json`) for the fits, run directories for the
gradient size M, the compute time and the measured step time.

Model of one step with N workers, M gradient bytes per worker:

- ring all-reduce in B buckets: T = 2(N-1)·B·alpha + 2(N-1)/N · M · beta
  (reduce-scatter then all-gather: 2(N-1) messages per bucket, each rank sends 2(N-1)/N of M).
  One fit per algorithm: "library" (the backend's own, Gloo on CPU; used for ddp and
  allreduce/library) and "ring" (ours; allreduce/ring). 1/beta is the bus bandwidth.
- parameter server with S shards: every worker pushes M and pulls M; each shard serves
  all N workers, 2·N·M/S bytes; T = 2·alpha_ps + max(2·M, 2·N·M/S) · beta_ps. The bench
  times a push and a pull with the server's SGD update between them, so beta_ps already
  holds the update cost per byte; there is no separate update term.
- local: T_comm = 0.

Step time = T_c + T_comm with no overlap of compute and communication: on the 2-core machine
the runs were measured on, communication and backward share the same cores, so an all-reduce
started inside backward slows backward down about as much as it would cost after it.
T_c is the median `compute_s` (forward + backward) over ranks and steps, step 0 skipped.
Throughput = N · batch_size / step time.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .linkmodel import run_link_time, run_psar_link_time
from experiments.engines import label_info

from .results import Run, family, median
from .traffic import run_traffic

MIB = 2**20
DEFAULT_WORKERS = tuple(2**k for k in range(11))  # 1 .. 1024
DEFAULT_SHARDS = ("1", "N/4", "N")

# Colours are analysis/style.py's, one per engine; PS shard settings differ by line style.
SHARD_STYLES = {"1": "-", "N/4": "--", "N": ":"}


@dataclass(frozen=True)
class Fit:
    """One link's cost of a message of n bytes: alpha_s + beta_s_per_byte · n."""

    alpha_s: float
    """Latency per message, seconds."""
    beta_s_per_byte: float
    """Seconds per byte (1/bandwidth)."""
    rel_rms: float = 0.0
    """Root mean square of the fit's relative error over the bench rows it was fitted to."""
    points: int = 0
    """Number of bench rows fitted."""

    def predict(self, nbytes: float) -> float:
        """Seconds for one message of `nbytes`."""
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def bandwidth_gbs(self) -> float:
        return 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


def fit_line(alpha_coef: Sequence[float], beta_coef: Sequence[float],
              times: Sequence[float]) -> Fit:
    """Least squares of t = a·alpha + b·beta on relative error (rows weighted by 1/t).

    Weighting by 1/t makes a 1 KiB row count as much as a 64 MiB one. Neither parameter may
    be negative: a negative one is set to 0 and the other refitted alone.
    """
    a, b, t = (np.asarray(x, dtype=np.float64) for x in (alpha_coef, beta_coef, times))
    if len(t) < 2 or len(set(zip(a.tolist(), b.tolist()))) < 2:
        raise ValueError(f"need at least 2 rows of different sizes to fit alpha and beta, got {len(t)}")
    if np.any(t <= 0):
        raise ValueError(f"bench times must be > 0, got {t.min()}")
    design = np.stack([a / t, b / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha < 0 or beta < 0:
        # One-parameter least squares of sum((c·x/t - 1)^2): x = sum(u) / sum(u^2), u = c/t.
        u = design[:, 1] if alpha < 0 else design[:, 0]
        value = float(u.sum() / (u * u).sum())
        alpha, beta = (0.0, value) if alpha < 0 else (value, 0.0)
    rel = (a * alpha + b * beta) / t - 1.0
    return Fit(float(alpha), float(beta), float(np.sqrt(np.mean(rel**2))), len(t))


def fit_allreduce(table: dict, algorithm: str) -> Fit:
    """Fit alpha and beta of one algorithm ("library" or "ring") to a bench allreduce_table.

    Each row is one all-reduce of `bytes` over `table["world"]` ranks in one bucket:
    t = 2(N-1)·alpha + 2(N-1)/N · bytes · beta.
    """
    world = int(table["world"])
    if world < 2:
        raise ValueError(f"allreduce_table world={world}: need >= 2 ranks to fit an all-reduce")
    rows = [r for r in table["rows"] if r["algorithm"] == algorithm]
    if not rows:
        found = sorted({r["algorithm"] for r in table["rows"]})
        raise ValueError(f"allreduce_table has no rows for algorithm {algorithm!r} "
                         f"(found: {', '.join(found) or 'none'})")
    steps = 2 * (world - 1)
    return fit_line([steps] * len(rows), [steps / world * r["bytes"] for r in rows],
                     [r["time_us"] * 1e-6 for r in rows])


def fit_ps(rows: list[dict]) -> Fit:
    """Fit alpha_ps and beta_ps to the bench's ps_bandwidth rows: t = 2·alpha + 2·bytes·beta.

    A row is one push plus one pull of `bytes` with the server's update between them, so
    beta_ps includes the update's cost per byte.
    """
    if not rows:
        raise ValueError("ps_bandwidth has no rows")
    return fit_line([2] * len(rows), [2 * r["bytes"] for r in rows],
                     [r["ps_us"] * 1e-6 for r in rows])


def bucket_count(nbytes: float, cap_mb: float = 25.0, first_mb: float = 1.0) -> int:
    """ceil(M / cap) buckets, at least 1, plus the small first bucket when M exceeds it."""
    count = max(1, math.ceil(nbytes / (cap_mb * MIB)))
    return count + (1 if nbytes > first_mb * MIB else 0)


@dataclass(frozen=True)
class CostModel:
    """The fitted parameters of every engine's communication; a fit is None if the bench lacked it."""

    library: Fit | None
    """The backend's own all-reduce (ddp, allreduce/library)."""
    ring: Fit | None
    """Our ring all-reduce (allreduce/ring)."""
    ps: Fit | None
    """Parameter server push + pull, one worker against one shard (ps-*)."""
    world: int = 2
    """Ranks of the bench's all-reduce table."""
    backend: str = ""
    """Backend of the bench's all-reduce table (gloo, nccl)."""

    @classmethod
    def from_bench(cls, path: Path) -> "CostModel":
        """Fit every model that the bench report at `path` has rows for."""
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read bench report {path}: {err}") from None
        table = report.get("allreduce_table")
        if table is None and not report.get("ps_bandwidth"):
            raise ValueError(f"{path} has neither allreduce_table nor ps_bandwidth: "
                             "is it a bench.json written by `psar bench`?")
        algorithms = {r["algorithm"] for r in table["rows"]} if table else set()
        return cls(
            library=fit_allreduce(table, "library") if "library" in algorithms else None,
            ring=fit_allreduce(table, "ring") if "ring" in algorithms else None,
            ps=fit_ps(report["ps_bandwidth"]) if report.get("ps_bandwidth") else None,
            world=int(table["world"]) if table else 2,
            backend=table.get("backend", "") if table else "",
        )

    def _fit(self, name: str, label: str) -> Fit:
        fit = getattr(self, name)
        if fit is None:
            raise ValueError(f"no {name!r} fit for {label}: the bench report had no rows for it")
        return fit

    def comm_time(self, label: str, workers: int, servers: int, nbytes: float,
                  buckets: int = 1, pull_bytes: float | None = None, gathered: float = 0.0) -> float:
        """Seconds of communication per step for engine `label` (a Run.label).

        Args:
            label: a run label of a registered engine (experiments.engines).
            workers: N.
            servers: S, parameter-server shards (ignored by the other engines).
            nbytes: M, gradient bytes per worker per step (all-reduced, or pushed).
            buckets: B, all-reduces per step (ignored by local and ps-*); default 1.
            pull_bytes: ps: bytes each worker pulls per step (default M).
            gathered: +allgather: bytes each host sends into the all-gather of rows, over
                N-1 steps of the ring.
        """
        if workers < 1 or servers < 1 or buckets < 1 or nbytes < 0:
            raise ValueError(f"workers={workers}, servers={servers}, buckets={buckets} must be >= 1 "
                             f"and nbytes={nbytes} >= 0")
        kind = family(label)
        if kind == "local":
            return 0.0
        if kind in ("ring", "sharded"):  # sharded: a reduce-scatter and an all-gather, the ring's two halves
            fit = self._fit(label_info(label)[1].fit or "library", label)
            steps = 2 * (workers - 1)
            gather = ((workers - 1) * fit.alpha_s + gathered * fit.beta_s_per_byte) if gathered else 0.0
            return steps * buckets * fit.alpha_s + steps / workers * nbytes * fit.beta_s_per_byte + gather
        if kind == "gossip":  # its models to its out-neighbours at once: one latency, their bytes
            from .linkmodel import gossip_degree

            fit = self._fit(label_info(label)[1].fit or "library", label)
            return fit.alpha_s + gossip_degree(label, workers) * nbytes * fit.beta_s_per_byte
        fit = self._fit(label_info(label)[1].fit or "ps", label)
        # A worker pushes and pulls M in all (M/S on each shard, in parallel); a shard serves
        # the push+pull rounds of all N workers one after another: 2NM/S bytes and 2N
        # messages. The busier of the two sets the time.
        both = nbytes + (nbytes if pull_bytes is None else pull_bytes)
        worker = 2 * fit.alpha_s + both * fit.beta_s_per_byte
        shard = workers * (2 * fit.alpha_s + both / servers * fit.beta_s_per_byte)
        return max(worker, shard)

    def predict_step(self, label: str, workers: int, servers: int, nbytes: float,
                     compute_s: float, buckets: int = 1) -> float:
        """Seconds per step: compute_s + comm_time (no overlap; see the module docstring)."""
        return compute_s + self.comm_time(label, workers, servers, nbytes, buckets)


# ---------------------------------------------------------------- quantities read from runs

def _after_first(run: Run, key: str) -> list[float]:
    values = [r[key] for r in run.steady_records()]
    if not values:
        raise ValueError(f"{run.path} has no metrics records")
    return values


def compute_time(run: Run) -> float:
    """T_c: the median over ranks and steps (step 0 skipped) of step_s - comm_s: forward,
    backward and whatever else a worker does by itself (the local optimizer of the all-reduce
    engines, copying pulled parameters in)."""
    return median([r["step_s"] - r["comm_s"] for r in run.steady_records()])


def measured_step(run: Run) -> float:
    """Median step_s over ranks and steps, step 0 skipped. A run that communicates once in
    H steps (run.period) takes the mean over whole periods instead: the median would land
    on its local steps."""
    h = run.period
    if h <= 1:
        return median(_after_first(run, "step_s"))
    records = run.steady_records()
    end = (max(r["step"] for r in records) + 1) // h * h  # steps p*h .. p*h + h-1 end with an exchange
    whole = [r for r in records if h <= r["step"] < end]  # the first period lost its step 0
    return statistics.fmean(r["step_s"] for r in whole or records)


def run_buckets(run: Run, nbytes: float) -> int:
    """B for a run: from its allreduce.bucket_cap_mb and first_bucket_mb (defaults 25, 1)."""
    section = run.config.get("allreduce", {})
    return bucket_count(nbytes, section.get("bucket_cap_mb", 25.0), section.get("first_bucket_mb", 1.0))


# ---------------------------------------------------------------- validation against runs

def validate(model: CostModel | None, runs: Iterable[Run]) -> list[dict]:
    """Predicted against measured step time, one row per run, each with its own T_c and M.

    A run on an emulated network (--net) is predicted from its link's rate alone
    (analysis/linkmodel.py), the others from the fitted model (None: only networked runs).
    ddp runs are left out (EngineSpec.comm_in_backward): DDP communicates inside backward, so
    its compute and communication are not measured apart and T_c cannot be read off them.
    """
    rows = []
    for run in runs:
        label = run.label
        if run.spec.comm_in_backward:
            continue
        workers = int(run.config.get("workers", run.summary.get("workers", 1)))
        servers = int(run.config.get("servers", 1)) if family(label) == "ps" else None
        traffic = run_traffic(run)
        nbytes = traffic.push
        buckets = run_buckets(run, nbytes) if family(label) == "ring" else None
        compute_s = compute_time(run)
        link = run_link_time(run, traffic)
        psar_s = None
        if link is not None:
            net = run.summary["network"]
            where = f", shards {run.placement}" if run.placement else ""
            predicted, basis = compute_s + link, f"ideal at {net['rate']}{where}"
            psar_link = run_psar_link_time(run, traffic)
            psar_s = None if psar_link is None else compute_s + psar_link
            if int(net.get("racks") or 1) > 1:
                basis += f", {net['racks']} racks behind {net.get('uplink') or 'unshaped'} uplinks"
        elif model is None:
            raise ValueError(f"{run.path} ran on loopback: its prediction needs a bench fit (--bench)")
        else:
            predicted = compute_s + model.comm_time(label, workers, servers or 1, nbytes, buckets or 1,
                                                    traffic.pull, traffic.gathered)
            basis = "bench fit"
        measured = measured_step(run)
        rows.append({"label": label, "workers": workers, "servers": servers,
                     "M_MB": nbytes / 1e6, "buckets": buckets, "compute_s": compute_s,
                     "predicted_s": predicted, "measured_s": measured, "basis": basis, "psar_model_s": psar_s,
                     "error": predicted / measured - 1.0})
    return sorted(rows, key=lambda r: (r["label"], r["workers"], r["servers"] or 0))


def format_validation(rows: list[dict], tolerance: float = 0.25) -> str:
    """A plain text table of validate()'s rows, ending with how many are within `tolerance`.
    On an emulated network `predicted` is the algorithm's ideal, and `psar model` the model
    of psar's own exchange beside it."""
    width = max([18] + [len(r["label"]) for r in rows])
    head = (f"{'engine':<{width}} {'N':>4} {'S':>4} {'M(MB)':>9} {'B':>3} {'compute(s)':>11} "
            f"{'predicted(s)':>13} {'measured(s)':>12} {'error':>8} {'psar model(s)':>14}  basis")
    lines = [head]
    for r in rows:
        servers = "-" if r["servers"] is None else str(r["servers"])
        buckets = "-" if r.get("buckets") is None else str(r["buckets"])
        psar = "-" if r.get("psar_model_s") is None else f"{r['psar_model_s']:.4f}"
        lines.append(f"{r['label']:<{width}} {r['workers']:>4} {servers:>4} {r['M_MB']:>9.3f} {buckets:>3} "
                     f"{r['compute_s']:>11.4f} {r['predicted_s']:>13.4f} {r['measured_s']:>12.4f} "
                     f"{r['error']:>+8.1%} {psar:>14}  {r.get('basis', '')}")
    within = sum(1 for r in rows if abs(r["error"]) <= tolerance)
    lines.append(f"within {tolerance:.0%}: {within} of {len(rows)} runs")
    return "\n".join(lines)


def fit_summary(model: CostModel) -> str:
    """The fitted parameters: alpha in µs, 1/beta in GB/s, and how well each fit the bench."""
    names = [("library", f"all-reduce, library ({model.backend or '?'}, fitted on {model.world} ranks)"),
             ("ring", f"all-reduce, ring (fitted on {model.world} ranks)"),
             ("ps", "parameter server push+pull, incl. update (1 worker, 1 shard)")]
    lines = []
    for name, title in names:
        fit = getattr(model, name)
        if fit is None:
            lines.append(f"{title}: no bench rows")
            continue
        lines.append(f"{title}: alpha {fit.alpha_s * 1e6:.1f} us, 1/beta {fit.bandwidth_gbs:.3f} GB/s "
                     f"(rms relative error {fit.rel_rms:.1%} over {fit.points} sizes)")
    return "\n".join(lines)


# ---------------------------------------------------------------- predictions at scale

def shard_count(setting: str | int, workers: int) -> int:
    """S for a setting: an int, "N" or "N/k" (at least 1)."""
    if isinstance(setting, int):
        return setting
    text = str(setting).replace(" ", "")
    if text == "N":
        return workers
    match = re.fullmatch(r"N/(\d+)", text)
    if match:
        return max(1, workers // int(match.group(1)))
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"shard setting {setting!r}: expected an integer >= 1, 'N' or 'N/k'")


def scaling(model: CostModel, nbytes: float, compute_s: float, batch_size: int,
            workers: Sequence[int] = DEFAULT_WORKERS, shards: Sequence[str | int] = DEFAULT_SHARDS,
            allreduce: Sequence[str] = ("allreduce/ring",), ps: str = "ps-sync") -> list[dict]:
    """Predicted step time and throughput as N grows, for the all-reduce labels and PS shard settings.

    Args:
        nbytes: M, gradient bytes per worker per step.
        compute_s: T_c, seconds of forward + backward per worker per step.
        batch_size: examples per worker per step.
        workers: values of N (default 1, 2, 4, ..., 1024).
        shards: S settings for the PS: an int, "N" or "N/k" (default 1, N/4, N).
        allreduce: all-reduce engine labels to include (default the ring).
        ps: the PS engine label (all ps-* share one model).
    """
    buckets = bucket_count(nbytes)
    settings = [(label, label, lambda n: None) for label in allreduce]
    settings += [(ps, f"ps S={s}", lambda n, s=s: shard_count(s, n)) for s in shards]
    rows = []
    for label, setting, servers_of in settings:
        for n in workers:
            servers = servers_of(n)
            comm = model.comm_time(label, n, servers or 1, nbytes, buckets)
            step = compute_s + comm
            rows.append({"setting": setting, "engine": label, "workers": n, "servers": servers,
                         "M_MB": nbytes / 1e6, "compute_s": compute_s, "comm_s": comm,
                         "step_s": step, "samples_per_sec": n * batch_size / step})
    return rows


def plot_scaling(rows: list[dict], out_dir: Path) -> list[Path]:
    """Write model_step_time.png and model_throughput.png under out_dir; return their paths."""
    from . import style  # first: selects the Agg backend before pyplot loads
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    note = ""
    if rows:
        note = f" (M = {rows[0]['M_MB']:.1f} MB, compute {rows[0]['compute_s'] * 1e3:.0f} ms/step)"
    paths = []
    for key, ylabel, name in (("step_s", "predicted step time (s)", "model_step_time.png"),
                              ("samples_per_sec", "predicted throughput (samples/s)",
                               "model_throughput.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for setting in settings:
            mine = sorted((r for r in rows if r["setting"] == setting), key=lambda r: r["workers"])
            engine = mine[0]["engine"]
            dashes = SHARD_STYLES.get(setting.split("S=")[-1], "-") if "S=" in setting else "-"
            ax.plot([r["workers"] for r in mine], [r[key] for r in mine], marker="o", markersize=3,
                    linestyle=dashes, color=style.colour(engine), label=setting)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers N")
        ax.set_ylabel(ylabel)
        ax.set_title("alpha-beta model" + note, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=style.DPI)
        plt.close(fig)
        paths.append(path)
    return paths
