"""The compression and period comparisons' reports on hand-written runs: each method against its engine's
uncompressed run at the same rate, and the crossover rates (predicted from bytes and
compression compute, measured from step times at two rates) where the arithmetic is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.compression import (crossover_bracket, markdown, measured_crossover, predicted_crossover, report,
                                  rows, uncompressed_step)
from analysis.results import Run
from experiments.settings.net import parse_rate

COMPUTE = 0.015


def _run(method: str, rate: str, sent: float, compress_s: float | None, accuracy: float = 0.9,
         steps: int = 12) -> Run:
    bits = parse_rate(rate)
    # the cost model, exactly: uncompressed, the link hides the backward (2/3 of compute)
    step = COMPUTE + compress_s + 8 * sent / bits if compress_s else \
        COMPUTE / 3 + max(2 * COMPUTE / 3, 8 * sent / bits)
    summary = dict(experiment="mlp-mid", engine="allreduce", workers=2, servers=1, samples_per_sec=1.0,
                   final_loss=0.5, eval={"accuracy": accuracy}, bytes_per_worker_per_step=2 * sent,
                   sent_bytes_per_worker_per_step=sent, recv_bytes_per_worker_per_step=sent,
                   compress_s_per_step=compress_s, network={"rate": rate, "placement": "colocated"})
    config = {"target_loss": 1.0, "compress": {"method": method, "ratio": 0.01} if method != "none" else {}}
    records = [dict(step=s, loss=2.0 - s * 0.2, time=(s + 1) * step, comm_s=step - COMPUTE, step_s=step,
                    bytes_sent=sent, bytes_recv=sent, **({"compress_s": compress_s} if compress_s else {}))
               for s in range(steps)]
    return Run(Path(f"/runs/{method}-{rate}"), config, summary, {0: records, 1: records})


def test_crossover_where_saved_link_time_equals_compression_compute(tmp_path):
    # 2.5 MB dense, 50 KB top-k with 10 ms of compression and 15 ms of compute:
    # (2.5e6 - 5e4) * 8 / (0.010 + 0.010) = 980 Mbit/s
    runs = [_run("none", r, 2.5e6, None) for r in ("100mbit", "1gbit")] + \
           [_run("topk", r, 5e4, 0.01, accuracy=0.88) for r in ("100mbit", "1gbit")]
    dense = {r.summary["network"]["rate"]: r for r in runs[:2]}
    topk = {r.summary["network"]["rate"]: r for r in runs[2:]}
    assert predicted_crossover(dense["1gbit"], topk["1gbit"]) == pytest.approx(0.98e9)
    # step times made by the model itself (link-bound at both rates): the measured crossover is the same rate
    assert measured_crossover(dense, topk) == pytest.approx(0.98e9, rel=1e-9)
    table = rows(runs)
    top = [row for row in table if row["method"] == "topk 0.01"]
    assert [row["rate"] for row in top] == ["100mbit", "1gbit"]
    slow = top[0]
    assert slow["step_speedup"] == pytest.approx((COMPUTE / 3 + 0.2) / (COMPUTE + 0.01 + 0.004))
    assert slow["metric_delta"] == pytest.approx(-2.0) and slow["crossover_mbit"] == pytest.approx(980)
    assert top[1]["measured_crossover_mbit"] == pytest.approx(980) and slow["measured_crossover_mbit"] is None
    assert slow["target_speedup"] == pytest.approx(slow["step_speedup"])
    text, paths = report(runs, tmp_path)
    assert "| 100mbit | allreduce/library | topk 0.01 |" in text and text == markdown(table)
    assert {p.name for p in paths} == {"compression.md", "compression.csv", "compression_loss_vs_time.png",
                                       "compression_speedup_vs_rate.png"}


def test_the_measured_crossover_is_read_between_the_rates_around_it():
    """Above 2 Gbit/s the uncompressed exchange hides behind the backward and its step stops
    falling with 1/R: a line through the slowest and fastest rates would miss the crossover
    (980 Mbit/s), the one through the rates around it does not."""
    rates = ("100mbit", "500mbit", "1gbit", "4gbit")
    dense = {r: _run("none", r, 2.5e6, None) for r in rates}
    topk = {r: _run("topk", r, 5e4, 0.01) for r in rates}
    assert crossover_bracket(dense, topk) == ("500mbit", "1gbit")
    assert measured_crossover(dense, topk) == pytest.approx(0.98e9, rel=1e-9)
    ends = {r: dense[r] for r in ("100mbit", "4gbit")}, {r: topk[r] for r in ("100mbit", "4gbit")}
    assert crossover_bracket(*ends) == ("100mbit", "4gbit")  # the only rates around it: 1283 Mbit/s
    assert measured_crossover(*ends) != pytest.approx(0.98e9, rel=0.25)
    for r in topk["1gbit"].metrics[0]:  # one run of the method 20% slow (both ranks share the list)
        r["step_s"] *= 1.2
    # the median of the slopes through all four rates does not see it (the line through 500mbit and 1gbit
    # alone moves the crossover 16%, the least-squares line through all four 8%)
    assert measured_crossover(dense, topk) == pytest.approx(0.98e9, rel=1e-9)


def test_the_uncompressed_step_sends_its_buckets_as_backward_makes_them():
    """With the buckets' times on record (1 MB ready 2 ms into a 10 ms backward, 1.5 MB at 9
    ms), each is sent once ready and the one before it is done: at 1gbit the second waits for
    the first until 10 ms and ends 12 ms after backward (t_0 = 15 + 12 ms, where one bucket as
    backward begins gives 25 ms); the step pays for top-k up to 1.96e7 / 0.018 bit/s."""
    dense, topk = _run("none", "1gbit", 2.5e6, None), _run("topk", "1gbit", 5e4, 0.01)
    for r in dense.metrics[0]:  # both ranks share the list
        r.update(backward_s=0.010, buckets=[[0.002, 1e6], [0.009, 1.5e6]], comm_s=r["step_s"] - COMPUTE)
    assert uncompressed_step(dense, 1e9) == pytest.approx(0.027, rel=1e-12)
    assert predicted_crossover(dense, topk) == pytest.approx(1.96e7 / 0.018, rel=1e-9)


def test_no_crossover_without_a_saving_or_a_measured_compute():
    dense, cast = _run("none", "1gbit", 2.5e6, None), _run("fp16", "1gbit", 1.25e6, None)
    assert predicted_crossover(dense, cast) is None
    assert predicted_crossover(dense, _run("sign", "1gbit", 3e6, 0.01)) is None  # sends more
    assert measured_crossover({"1gbit": dense}, {"1gbit": cast}) is None  # one rate only


def test_the_compression_grid_builds_every_cell_at_both_rates():
    """Every method on allreduce and ps-sync and torch's hooks under ddp, at 100mbit and 1gbit;
    --net gives one rate instead. Each cell's settings are accepted as they stand."""
    from experiments.comparisons.grids import get_comparison
    from experiments.settings.presets import build_config

    grid = get_comparison("compression")
    cells = grid.variants_at(None)
    assert len(cells) == 2 * len(grid.variants) == 34
    methods = {(v.engine, next((o.split("=")[1] for o in v.overrides if o.startswith("compress.method=")), "none"))
               for v in cells}
    assert {m for e, m in methods if e == "ps-sync"} == {"none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd"}
    assert {m for e, m in methods if e == "allreduce"} == {"none", "fp16", "bf16", "topk", "randomk", "sign",
                                                           "qsgd", "powersgd"}
    assert grid.variants_at("200mbit") == grid.variants
    for v in cells:
        cfg = build_config(grid.experiment, grid.overrides + v.overrides, engine=v.engine, workers=2,
                           servers=v.shards(2), steps=grid.steps)
        assert cfg.net.rate in ("100mbit", "1gbit")


def test_the_period_grid_and_its_report(tmp_path):
    """Periods 1, 4, 16 on allreduce, ps-sync, ps-async (Downpour) and ps-easgd; the report
    predicts a period's step as compute plus the period-1 run's communication over H."""
    from analysis.period import report
    from experiments.comparisons.grids import get_comparison
    from experiments.settings.presets import build_config

    grid = get_comparison("period")
    assert len(grid.variants) == 12 and grid.net == "100mbit"
    for v in grid.variants:
        build_config(grid.experiment, grid.overrides + v.overrides, engine=v.engine, workers=2,
                     servers=v.shards(2), steps=grid.steps)

    def run(period, step):
        records = [dict(step=s, loss=2.0 - 0.1 * s, time=(s + 1) * step, comm_s=step - 0.01, step_s=step,
                        bytes_sent=1e6 / period, bytes_recv=1e6 / period) for s in range(12)]
        config = {"target_loss": 1.5, "allreduce": {"period": period}}
        summary = dict(experiment="mlp-mid", engine="allreduce", workers=2, servers=1, final_loss=0.9,
                       eval={"accuracy": 0.9}, bytes_per_worker_per_step=2e6 / period)
        return Run(Path(f"/runs/p{period}"), config, summary, {0: records})

    text, paths = report([run(1, 0.21), run(4, 0.06)], tmp_path)
    # compute 0.01 s, communication 0.2 s: every 4 steps predicted 0.01 + 0.05 = 60 ms, measured 60
    assert "| allreduce/library | 4 | 500 | 60 | 60 | +0% |" in text
    assert {p.name for p in paths} == {"period.md", "period.csv", "period_loss_vs_time.png"}


def test_a_periods_step_is_the_mean_over_whole_periods():
    """Every 4th step exchanges (0.2 s), the others are local (0.01 s): the median (0.01)
    would say nothing of the exchange; the mean over whole periods, step 0's period left
    out, is (3 * 0.01 + 0.2) / 4."""
    from analysis.costmodel import measured_step

    step_s = [0.5] + [0.2 if (s + 1) % 4 == 0 else 0.01 for s in range(1, 14)]  # steps 4-11: two whole periods
    records = [dict(step=s, step_s=t, comm_s=t - 0.01, loss=1.0, time=float(s)) for s, t in enumerate(step_s)]
    run = Run(Path("/runs/p4"), {"allreduce": {"period": 4}}, dict(engine="allreduce", workers=2), {0: records})
    assert measured_step(run) == pytest.approx((3 * 0.01 + 0.2) / 4)
    every = Run(Path("/runs/p1"), {"allreduce": {"period": 1}}, dict(engine="allreduce", workers=2), {0: records})
    assert measured_step(every) == 0.01  # the plain median where every step exchanges
