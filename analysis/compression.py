"""The compression comparison: each method against the uncompressed run of its engine on
links of the same rate, and the rate above which it no longer pays.

Cost model (the algorithm's, not a fit), from a pair of runs at one rate R_0: a step costs
its compute c (measured, of the uncompressed run: the step less the exchange it waited for)
and its bytes b on the busier direction of a worker's link over the rate R (medians over the
steps after the first). Uncompressed, the gradients leave during backward as its buckets
become ready (bucketed, from hooks): the step is c and what of the exchange is left after
backward, each bucket's share of b_0/R sent once it is ready and the one before it is done,
at the bucket times the run recorded (analysis.overlap); a run without them has one bucket
ready as backward begins, two thirds of c (a backward costs twice a forward): t_0(R) = c/3 +
max(2c/3, b_0/R). Compressed, the hooks compress on the same cores and little is left to
hide: the step is the compute, the compression compute k (measured: a worker's compress_s,
plus under ps-sync a shard's decompression of the pushes and compression of the pull, per
step) and an exchange of few bytes, as the compressed run measured them at R_0, its bytes
moved to R: t_m(R) = t_m(R_0) + b_m/R - b_m/R_0 (c + k + b_m/R where the exchange is its
bytes alone). The method pays while t_m < t_0, up to R*, its predicted crossover, where
they are equal (R* = (b_0 - b_m) / (2c/3 + k) on a link-bound step of one bucket). The
measured crossover solves t_m(R) = t_0(R) with lines t = a + b / R: the method's through
its step times at every rate measured (Theil-Sen), the uncompressed run's through its
step times at the two rates around the crossover (the neighbours where the method stops
paying; the slowest and fastest measured where it never does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from experiments.settings.net import parse_rate

from .plots import loss_over_time, save_figure  # first: analysis.style selects the Agg backend
from .costmodel import compute_time, measured_step
from .overlap import exposed, timeline
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


def _uncompressed(base: Run) -> Callable[[float], float]:
    """R -> t_0(R): c and the exchange left after backward, from base's bucket times where
    it recorded them (analysis.overlap), else from one bucket as backward begins."""
    c, bits, line = compute_time(base), 8 * _bytes(base), timeline(base)
    if line is None:
        return lambda rate: c / 3 + max(2 * c / 3, bits / rate)
    return lambda rate: c + exposed(line, lambda share: share * bits / rate)


def uncompressed_step(base: Run, rate_bits: float) -> float:
    """t_0 at rate_bits (_uncompressed)."""
    return _uncompressed(base)(rate_bits)


def step_model(base: Run, run: Run) -> Callable[[float], tuple[float, float]] | None:
    """R -> (t_0, t_m), the model's uncompressed and compressed step, t_m(R) the method's step
    as measured on its own links (rate R_0), its bytes moved to R: + 8 b_m (1/R - 1/R_0);
    None without a measured compression compute k or a link rate. Read off the runs once."""
    own = rate_of(run)
    if codec_s(run) is None or not own:
        return None
    t_0, step, bits, r_0 = _uncompressed(base), measured_step(run), 8 * _bytes(run), parse_rate(own)
    return lambda rate: (t_0(rate), step + bits * (1 / rate - 1 / r_0))


def predicted_crossover(base: Run, run: Run) -> float | None:
    """R* in bit/s, where t_m(R) = t_0(R) (t_m - t_0 grows with R: the method saves bytes);
    None without a measured compression time, a link rate or a saving, or where the method
    does not pay even at 1 kbit/s."""
    k, model = codec_s(run), step_model(base, run)
    if not k or k <= 0 or _bytes(base) <= _bytes(run) or model is None:
        return None

    def pays(rate: float) -> bool:
        t_0, t_m = model(rate)
        return t_m < t_0

    low, high = 1e3, 1e15
    if not pays(low):
        return None
    for _ in range(200):  # on a log scale, to a relative 1e-12
        mid = (low * high) ** 0.5
        low, high = (mid, high) if pays(mid) else (low, mid)
        if high / low < 1 + 1e-12:
            break
    return (low * high) ** 0.5


def _common_rates(base: dict[str, Run], series: dict[str, Run]) -> list[str]:
    """The link rates both series were measured at, slowest first (loopback left out)."""
    return sorted((r for r in series if r and r in base), key=parse_rate)


def _line(runs: dict[str, Run], rates: list[str]) -> tuple[float, float]:
    """(a, b) of the line t = a + b / R through runs' step times at rates (Theil-Sen: b the
    median of the slopes between every two rates, a the median of t - b / R; the line through
    them where there are two), which one run's stall on a shared machine does not tilt."""
    xs = [1 / parse_rate(r) for r in rates]
    ts = [measured_step(runs[r]) for r in rates]
    b = median([(ts[j] - ts[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))])
    return median([t - b * x for x, t in zip(xs, ts)]), b


def crossover_bracket(base: dict[str, Run], series: dict[str, Run]) -> tuple[str, str] | None:
    """The two rates the uncompressed run's line is drawn between: the first neighbours, in
    rising rate, where the method goes from faster than it to slower; the slowest and fastest
    rate where it never does (the lines then extrapolate); None with fewer than two rates on
    both. The method's step is its line through all rates (measured_crossover)."""
    rates = _common_rates(base, series)
    if len(rates) < 2:
        return None
    a_m, b_m = _line(series, rates)
    pays = [a_m + b_m / parse_rate(r) < measured_step(base[r]) for r in rates]
    for i in range(len(rates) - 1):
        if pays[i] and not pays[i + 1]:
            return rates[i], rates[i + 1]
    return rates[0], rates[-1]


def measured_crossover(base: dict[str, Run], series: dict[str, Run]) -> float | None:
    """Where the method's step and the uncompressed run's meet, in bit/s: the method's as the
    line t = a + b / R through its step times at every rate (_line; it hides nothing
    behind backward, so one line holds at all of them, and each run's noise weighs less), the
    uncompressed run's as the line through its step times at the two rates of
    crossover_bracket (above the rate where its exchange hides behind its backward, its step
    no longer falls with 1/R, so a line holds between two rates at most); None with fewer
    than two rates on both, or where they do not meet at a positive rate."""
    bracket = crossover_bracket(base, series)
    if bracket is None:
        return None
    (a_0, b_0), (a_m, b_m) = _line(base, list(bracket)), _line(series, _common_rates(base, series))
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
                common = _common_rates(base, series[(label, method)])
                if not common:
                    continue
                one, b0 = series[(label, method)][common[0]], base[common[0]]  # the model from the slowest rate's pair
                model = step_model(b0, one)
                if model is not None:
                    steps = [model(g) for g in grid]
                    ax.plot([g / 1e6 for g in grid], [t0 / tm for t0, tm in steps], ":", color=colour, linewidth=1)
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
