"""analysis/sharded.py: the paper's bytes per worker beside the measured ones, and the figure
of memory against time per step."""

from __future__ import annotations

import json

import pytest

from analysis.results import load_run
from analysis.sharded import formula, report, rows
from tests.unit.test_labels import M, fake_run


def run_with(tmp_path, name, engine, memory, stage=1, optim=None, shard=None):
    run = fake_run(tmp_path / name, engine, stage=stage)
    config = json.loads((run.path / "config.json").read_text())
    config["optim"] = optim or {"name": "adamw"}
    (run.path / "config.json").write_text(json.dumps(config))
    summary = json.loads((run.path / "summary.json").read_text())
    summary["memory_bytes_per_worker"] = memory
    if shard:
        summary["memory_bytes_per_shard"] = shard
    (run.path / "summary.json").write_text(json.dumps(summary))
    return load_run(run.path)


@pytest.mark.parametrize("engine, stage, expected", [
    ("allreduce", 1, (M, M, 2 * M)), ("zero", 1, (M, M, M)), ("zero", 2, (M, M / 2, M)),
    ("zero", 3, (M / 2, M / 2, M)), ("ps-sync", 1, (M, M, 0))])
def test_the_papers_bytes_per_worker_for_adamw_on_two_workers(tmp_path, engine, stage, expected):
    run = run_with(tmp_path, "r", engine, {}, stage=stage)
    assert tuple(formula(run).values()) == expected


def test_sgd_with_momentum_keeps_one_byte_of_state_per_byte(tmp_path):
    run = run_with(tmp_path, "r", "allreduce", {}, optim={"name": "sgd", "momentum": 0.9})
    assert formula(run)["optimizer"] == M


def test_the_table_sets_measured_beside_formula_and_draws_memory_against_step(tmp_path):
    runs = [run_with(tmp_path, "ar", "allreduce", {"params": M, "grads": M, "optimizer": 2 * M, "comm_buffers": 0}),
            run_with(tmp_path, "z3", "zero", {"params": M / 2, "grads": M / 2, "optimizer": M,
                                               "comm_buffers": M / 4}, stage=3),
            run_with(tmp_path, "ps", "ps-sync", {"params": M, "grads": M, "optimizer": 0, "comm_buffers": 0},
                     shard={"params": M / 2, "grads": M / 2, "optimizer": M, "comm_buffers": 0})]
    table = {r["engine"]: r for r in rows(runs)}
    assert table["allreduce/library"]["formula_mb"] == table["allreduce/library"]["measured_mb"] == 4 * M / 1e6
    assert table["zero-3"]["measured_mb"] == pytest.approx(2 * M / 1e6) and table["zero-3"]["comm_mb"] == M / 4e6
    assert table["ps-sync"]["shard_mb"] == 2 * M / 1e6 and table["zero-3"]["theory_ms"] > 0
    text, paths = report(runs, tmp_path / "out")
    assert "formula MB" in text and (tmp_path / "out" / "memory_vs_step.png").exists()


def test_psar_models_memory_table_scales_the_formula_and_sets_each_run_beside_it(tmp_path):
    from analysis.sharded import bytes_per_worker, format_memory

    assert bytes_per_worker("zero-1", M, 2, 1) == bytes_per_worker("replicated", M, 2, 1) == 4 * M
    assert bytes_per_worker("zero-3", M, 2, 1024) == 4 * M / 1024
    assert bytes_per_worker("zero-2", M, 2, 4) == M + 3 * M / 4
    run = run_with(tmp_path, "z1", "zero", {"params": M, "grads": M, "optimizer": M, "comm_buffers": 0})
    text = format_memory([run])
    assert "N=1024" in text and "zero-1 x2: 3.15 (formula 3.15; comm buffers 0)" in text
