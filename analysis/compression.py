"""The compression comparison: each method against the uncompressed run of its engine on
links of the same rate, and the rate above which it no longer pays.

Cost model (the algorithm's, not a fit): a step costs its compute c (measured, of the
uncompressed run), its compression compute k (measured: a worker's compress_s, plus under
ps-sync a shard's decompression of the pushes and compression of the pull, per step) and its
bytes b on the busier direction of a worker's link over the rate R (medians over the steps
after the first). Uncompressed, the gradients leave during backward (bucketed, from hooks),
so communication hides behind the backward pass, two thirds of c (a backward costs twice a
forward): t_0(R) = c/3 + max(2c/3, b_0/R). Compressed, the hooks compress on the same cores
and little is left to hide: t_m(R) = c + k + b_m/R. The method pays while t_m < t_0; on a
link-bound step that is R < R* = (b_0 - b_m) / (2c/3 + k), its predicted crossover. The
measured crossover puts a line t = a + b / R through each series' step times at two rates
(the slowest and fastest measured) and solves t_m(R) = t_0(R).
"""

from __future__ import annotations

from pathlib import Path

from experiments.settings.net import parse_rate

from .plots import loss_over_time, save_figure  # first: analysis.style selects the Agg backend
from .costmodel import compute_time, measured_step
from .results import Run, median, time_to_target
from .table import markdown as table_markdown
from .table import rate_of, write_report

import matplotlib.pyplot as plt

COLUMNS = [
    ("rate", "link"), ("engine", "engine"), ("method", "method"),
    ("sent_kb", "sent KB/step"), ("recv_kb", "recv KB/step"), ("step_ms", "step ms"),
    ("compress_ms", "compress ms"), ("shard_codec_ms", "shard codec ms"), ("step_speedup", "step speed-up"),
    ("time_to_target_s", "s to target"), ("target_speedup", "speed-up to target"),
    ("metric", "final metric"), ("metric_delta", "vs none (points)"),
    ("crossover_mbit", "predicted crossover Mbit/s"), ("measured_crossover_mbit", "measured crossover Mbit/s"),
]


def _bytes(run: Run) -> float:
    """Bytes per step on the busier direction of a worker's link (median over steps: PowerSGD's
    first steps go whole)."""
    return median([max(r["bytes_sent"], r["bytes_recv"]) for r in run.steady_records()]) or 0.0


def worker_codec_s(run: Run) -> float | None:
    """A worker's compression compute per step (median), None where not measured."""
    values = [r["compress_s"] for r in run.steady_records() if "compress_s" in r]
    return median(values) if values else None


def shard_codec_s(run: Run) -> float | None:
    """The busiest shard's decompression and compression per step (ps-*), None elsewhere."""
    stats = [s for s in run.summary.get("server_stats") or [] if s.get("codec_us") and s.get("version")]
    return max(s["codec_us"] / 1e6 / s["version"] for s in stats) if stats else None


def codec_s(run: Run) -> float | None:
    """k: what compression adds to a step, a worker's and a shard's (which run one after the
    other: the shard answers once it has decompressed every push and compressed the pull)."""
    parts = [x for x in (worker_codec_s(run), shard_codec_s(run)) if x is not None]
    return sum(parts) if parts else None


def _metric(run: Run) -> float | None:
    """The final evaluation's accuracy, in points (None where the experiment has none)."""
    accuracy = (run.summary.get("eval") or {}).get("accuracy")
    return None if accuracy is None else 100 * accuracy


def _series(runs: list[Run]) -> dict[tuple[str, str], dict[str, Run]]:
    """{(engine label, method): {rate: run}}; method "none" for the uncompressed runs."""
    out: dict[tuple[str, str], dict[str, Run]] = {}
    for run in runs:
        out.setdefault((run.label, run.compression or "none"), {})[rate_of(run)] = run
    return out


def step_model(base: Run, run: Run, rate_bits: float) -> tuple[float, float] | None:
    """(t_0, t_m): the model's uncompressed and compressed step at rate_bits; None without k."""
    k, c = codec_s(run), compute_time(base)
    if k is None:
        return None
    return (c / 3 + max(2 * c / 3, 8 * _bytes(base) / rate_bits),
            c + k + 8 * _bytes(run) / rate_bits)


def predicted_crossover(base: Run, run: Run) -> float | None:
    """R* = (b_0 - b_m) / (2c/3 + k) in bit/s; None without a measured compression time or a
    saving."""
    k = codec_s(run)
    saved = 8 * (_bytes(base) - _bytes(run))
    return saved / (2 * compute_time(base) / 3 + k) if k and k > 0 and saved > 0 else None


def measured_crossover(base: dict[str, Run], series: dict[str, Run]) -> float | None:
    """Where the lines t = a + b / R through the slowest and fastest rate's step times of the
    method and of the uncompressed run meet, in bit/s; None with fewer than two rates on both,
    or where they do not meet at a positive rate."""
    rates = sorted((r for r in series if r and r in base), key=parse_rate)
    if len(rates) < 2:
        return None
    lo, hi = rates[0], rates[-1]

    def line(runs: dict[str, Run]) -> tuple[float, float]:
        x0, x1 = 1 / parse_rate(lo), 1 / parse_rate(hi)
        t0, t1 = measured_step(runs[lo]), measured_step(runs[hi])
        b = (t0 - t1) / (x0 - x1)
        return t1 - b * x1, b

    (a_0, b_0), (a_m, b_m) = line(base), line(series)
    if a_m <= a_0 or b_0 <= b_m:
        return None
    return (b_0 - b_m) / (a_m - a_0)


def rows(runs: list[Run]) -> list[dict]:
    """One row per (rate, engine, method), each against its engine's uncompressed run there."""
    series = _series(runs)
    out = []
    for (label, method), by_rate in sorted(series.items()):
        base_series = series.get((label, "none"), {})
        for rate in sorted(by_rate, key=lambda r: parse_rate(r) if r else 0):
            run, base = by_rate[rate], base_series.get(rate)
            reached, base_reached = time_to_target(run), base and time_to_target(base)
            step = measured_step(run)
            k, shard = worker_codec_s(run), shard_codec_s(run)
            metric, base_metric = _metric(run), base and _metric(base)
            crossover = predicted_crossover(base, run) if base is not None and method != "none" else None
            measured = measured_crossover(base_series, by_rate) if method != "none" and rate == max(
                by_rate, key=lambda r: parse_rate(r) if r else 0) else None
            out.append({
                "rate": rate or "loopback", "engine": label, "method": method,
                "sent_kb": run.summary.get("sent_bytes_per_worker_per_step", 0) / 1e3,
                "recv_kb": run.summary.get("recv_bytes_per_worker_per_step", 0) / 1e3,
                "step_ms": 1e3 * step, "compress_ms": None if k is None else 1e3 * k,
                "shard_codec_ms": None if shard is None else 1e3 * shard,
                "step_speedup": measured_step(base) / step if base is not None else None,
                "time_to_target_s": reached[1] if reached else None,
                "target_speedup": base_reached[1] / reached[1] if reached and base_reached else None,
                "metric": metric,
                "metric_delta": metric - base_metric if metric is not None and base_metric is not None else None,
                "crossover_mbit": crossover / 1e6 if crossover else None,
                "measured_crossover_mbit": measured / 1e6 if measured else None,
            })
    return out


def markdown(table: list[dict]) -> str:
    return table_markdown(table, COLUMNS, missing="")


def loss_vs_time(runs: list[Run], out_dir: Path) -> Path | None:
    """Training loss against time, one panel per (rate, engine), a line per method."""
    panels = sorted({(rate_of(r), r.label) for r in runs}, key=lambda p: (parse_rate(p[0]) if p[0] else 0, p[1]))
    if not panels:
        return None
    rates = sorted({p[0] for p in panels}, key=lambda r: parse_rate(r) if r else 0)
    labels = sorted({p[1] for p in panels})
    fig, axes = plt.subplots(len(rates), len(labels), figsize=(4.2 * len(labels), 3.4 * len(rates)),
                             squeeze=False, sharey=True)
    methods = sorted({r.compression or "none" for r in runs})
    cmap = plt.get_cmap("tab10")
    try:
        for i, rate in enumerate(rates):
            for j, label in enumerate(labels):
                ax = axes[i][j]
                for run in sorted((r for r in runs if rate_of(r) == rate and r.label == label),
                                  key=lambda r: methods.index(r.compression or "none")):
                    method = run.compression or "none"
                    ax.plot(*loss_over_time(run), label=method,
                            color=cmap(methods.index(method) % 10), linewidth=2.2 if method == "none" else 1.3,
                            linestyle="-" if method == "none" else "--")
                ax.set(title=f"{label} on {rate or 'loopback'}", xlabel="time (s)", ylabel="training loss")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize="x-small")
        return save_figure(fig, out_dir, "compression_loss_vs_time.png")
    finally:
        plt.close(fig)


def speedup_vs_rate(runs: list[Run], out_dir: Path) -> Path | None:
    """Step-time speed-up over the uncompressed run against link rate, measured (markers) and
    as the cost model predicts it (lines), with each method's predicted crossover (dotted)."""
    series = _series(runs)
    labels = sorted({label for label, method in series if method != "none" and (label, "none") in series})
    if not labels:
        return None
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.0), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab10")
    methods = sorted({m for _, m in series})
    try:
        for ax, label in zip(axes[0], labels):
            base = series[(label, "none")]
            rated = [r for r in base if r]
            if not rated:
                continue
            lo, hi = min(parse_rate(r) for r in rated) / 3, max(parse_rate(r) for r in rated) * 3
            grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
            for method in methods:
                if method == "none" or (label, method) not in series:
                    continue
                colour = cmap(methods.index(method) % 10)
                points = sorted((parse_rate(r), measured_step(base[r]) / measured_step(run))
                                for r, run in series[(label, method)].items() if r and r in base)
                ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], "o-", color=colour, label=method)
                one = next(iter(series[(label, method)].values()))
                b0 = next(iter(base.values()))
                if codec_s(one):
                    model = [step_model(b0, one, g) for g in grid]
                    ax.plot([g / 1e6 for g in grid], [t0 / tm for t0, tm in model], ":", color=colour, linewidth=1)
                    crossover = predicted_crossover(b0, one)
                    if crossover and lo < crossover < hi:
                        ax.axvline(crossover / 1e6, color=colour, linestyle=":", linewidth=0.8)
            ax.axhline(1.0, color="#4d4d4d", linewidth=0.8)
            ax.set(xscale="log", yscale="log", title=label, xlabel="link rate (Mbit/s)",
                   ylabel="step speed-up over uncompressed")
            ax.grid(True, alpha=0.3, which="both")
            ax.legend(fontsize="x-small")
        return save_figure(fig, out_dir, "compression_speedup_vs_rate.png")
    finally:
        plt.close(fig)


def report(runs: list[Run], out_dir: Path) -> tuple[str, list[Path]]:
    """compression.md (and .csv) of rows(runs), and the two figures."""
    return write_report(rows(runs), out_dir, COLUMNS, "compression",
                        [loss_vs_time(runs, out_dir), speedup_vs_rate(runs, out_dir)])
