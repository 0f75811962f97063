"""The pieces of the faults comparison that need no processes: the straggler's stall, the
checkpoints a restart goes on from, what a restart cost, and the report's rows."""

from __future__ import annotations

import json

import pytest
import torch

from analysis import faults
from analysis.results import load_run
from experiments.harness import inject
from experiments.rundir.checkpoint import worker_path
from experiments.runtime.restarts import RestartError, Restarts, checkpoint_step
from experiments.settings.faults import FaultConfig


def test_a_straggler_takes_k_times_its_reference_steps_compute(monkeypatch):
    slept = []
    monkeypatch.setattr(inject.time, "sleep", slept.append)
    straggler = inject.Straggler(FaultConfig(slow_rank=1, slow_factor=3.0), rank=1)
    # step 0's compute (allocation) is not a reference; steps 1..3 are; it stalls from step 4
    for index, last in enumerate([None, 0.5, 0.10, 0.12, 0.11]):
        straggler.stall(index, last)
    assert slept == [pytest.approx(3 * 0.11 - 0.11)]
    straggler.stall(5, 0.05)  # it computed alone, faster: it stalls longer
    assert slept[-1] == pytest.approx(3 * 0.11 - 0.05)
    other = inject.Straggler(FaultConfig(slow_rank=1, slow_factor=3.0), rank=0)
    for index in range(6):
        other.stall(index, 0.1)
    assert len(slept) == 2


def test_kill_and_pause_strike_once_on_the_first_attempt(monkeypatch, tmp_path):
    fault = FaultConfig(kill_rank=2, kill_step=7, pause_rank=1, pause_step=3, pause_s=1.0)
    assert fault.kills(2, 7) and fault.kills(2, 9) and not fault.kills(2, 6) and not fault.kills(1, 7)
    assert fault.pauses(1, 3) and fault.pauses(1, 4) and not fault.pauses(1, 2)
    assert not FaultConfig(pause_rank=1, pause_step=3).pauses(1, 3)  # 0 s: nothing
    signals = []
    monkeypatch.setattr(inject.os, "kill", lambda pid, sig: signals.append(sig))
    monkeypatch.setattr(inject.subprocess, "Popen", lambda *a, **k: None)
    for rank in (1, 2):
        for restarts in (0, 1):
            faults = inject.Faults(fault, rank, restarts, tmp_path)
            for step in (0, 5, 8, 9):  # a worker gone on at the shards' step skips 3 and 7
                faults.before_step(step, 0.0)
    # rank 1 stops once, at step 5; rank 2 is killed at 8 (here the kill returns, and again at
    # 9); a restarted process is never struck
    assert signals == [inject.signal.SIGSTOP, inject.signal.SIGKILL, inject.signal.SIGKILL]
    for bad in (dict(kill_rank=-2), dict(kill_step=-1), dict(pause_s=-1.0), dict(pause_s=4000.0)):
        with pytest.raises(ValueError, match="fault."):
            FaultConfig(**bad)


def _checkpoint(run_dir, rank, step):
    path = worker_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "model": {}, "optimizer": None}, path)


def test_a_restart_goes_on_from_the_step_every_rank_checkpointed(tmp_path):
    assert checkpoint_step(tmp_path, 2) is None
    _checkpoint(tmp_path, 0, 8)
    with pytest.raises(RestartError, match="rank 0: step 8, rank 1: none"):
        checkpoint_step(tmp_path, 2)
    _checkpoint(tmp_path, 1, 4)
    with pytest.raises(RestartError, match="not of one step"):
        checkpoint_step(tmp_path, 2)
    _checkpoint(tmp_path, 1, 8)
    assert checkpoint_step(tmp_path, 2) == 8


def _records(run_dir, rank, steps_walls):
    path = run_dir / "metrics" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "wall": w, "time": 0.0, "loss": 1.0}) + "\n"
                            for s, w in steps_walls))


def test_a_restart_costs_the_steps_since_the_checkpoint_and_the_time_to_the_next_step(tmp_path):
    restarts = Restarts(tmp_path, 2, 1)
    for r in (0, 1):
        _records(tmp_path, r, [(s, 100.0 + s) for s in range(7)])
        _checkpoint(tmp_path, r, 4)
    assert restarts.left and restarts.failed("rank 1 was killed", 107.5) == 4
    for r in (0, 1):  # the restarted ranks redo steps 4.. from 109.0
        _records(tmp_path, r, [(s, 100.0 + s) for s in range(4)] + [(4, 109.0 + r), (5, 110.0 + r)])
        starts = tmp_path / "logs" / f"start-rank{r}.jsonl"
        starts.parent.mkdir(exist_ok=True)
        starts.write_text(json.dumps({"restarts": 1, "began": 108.0, "checkpoint_s": 0.1,
                                      "rendezvous_s": 0.4, "attached": 108.5}) + "\n")
    summary = restarts.finished()
    assert not restarts.left and summary["restarts"] == 1 and summary["steps_lost"] == 3
    (log,) = summary["restart_log"]
    assert log["resumed_step"] == 4 and log["recovery_s"] == pytest.approx(110.0 - 107.5)
    assert log["process_start_s"] == pytest.approx(0.5) and log["rest_s"] == pytest.approx(2.5 - 0.5 - 0.5)


def _run(tmp_path, name, engine, fault, walls, backups=0, compute=0.01, step=0.02, slow=None):
    path = tmp_path / name
    (path / "metrics").mkdir(parents=True)
    config = {"experiment": "cnn", "engine": engine, "workers": 4, "fault": fault,
              "ps": {"backup_workers": backups}, "allreduce": {}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps({"experiment": "cnn", "engine": engine, "workers": 4,
                                                   "final_loss": 0.5, "eval": {"accuracy": 0.9}}))
    for rank, rank_walls in walls.items():
        (path / "metrics" / f"rank{rank}.jsonl").write_text("".join(
            json.dumps({"step": i, "wall": w, "time": w - 100.0, "loss": 1.0, "step_s": step,
                        "compute_s": slow if slow is not None and rank == fault.get("slow_rank") else compute})
            + "\n" for i, w in enumerate(rank_walls)))
    return load_run(path)


def test_the_report_compares_each_fault_with_the_engines_run_without_one(tmp_path):
    none = _run(tmp_path, "a", "allreduce", {}, {r: [100.0 + 0.02 * i for i in range(11)] for r in range(4)})
    slow = _run(tmp_path, "b", "allreduce", {"slow_rank": 3, "slow_factor": 3.0},
                {r: [100.0 + 0.04 * i for i in range(11)] for r in range(4)}, slow=0.025)
    paused = _run(tmp_path, "c", "allreduce", {"pause_rank": 3, "pause_s": 10.0, "pause_step": 5},
                  {r: [100.0 + 0.02 * i + (10.0 if i >= 5 else 0.0) for i in range(11)] for r in range(4)})
    backup = _run(tmp_path, "d", "ps-sync", {"slow_rank": 3, "slow_factor": 3.0},
                  {r: [100.0 + 0.02 * i for i in range(11)] for r in range(3)}, backups=1)
    table = {(row["engine"], row["fault"]): row for row in faults.rows([none, slow, paused, backup])}
    assert table[("allreduce/library", "none")]["steps_per_s"] == pytest.approx(50.0)
    row = table[("allreduce/library", "rank 3 3x slower")]
    # the slow worker's compute as it ran (0.025 s) against the others' (0.01 s)
    assert row["vs_none"] == pytest.approx(0.5) and row["predicted"] == pytest.approx(0.02 / (0.02 + 0.015))
    assert table[("allreduce/library", "rank 3 stops 10 s at step 5")]["stall_s"] == pytest.approx(10.02)
    assert table[("ps-sync+backup", "rank 3 3x slower")]["vs_none"] is None  # no run without a fault
    assert faults.predicted(backup, backup) == 1.0


def test_backup_workers_throughput_counts_the_samples_the_updates_used():
    from experiments.rundir.metrics import applied_throughput, throughput

    def recs(steps_walls):
        return [{"step": s, "wall": w, "step_s": 1.0, "samples": 32} for s, w in steps_walls]

    # Three workers a step each second; the third's push of every step is dropped, and it
    # records only steps 0 and 3 (it went on at the shards' step), ending later each time.
    per_rank = {0: recs([(s, 1.0 + s) for s in range(6)]), 1: recs([(s, 1.0 + s) for s in range(6)]),
                2: recs([(0, 2.5), (3, 4.5)])}
    dropped = [1, 0, 0, 1, 0, 0]
    # steps 1..5 end at 2..6: from the warm-up's end (1.0) 5 s; two workers' 32 samples each
    assert applied_throughput(per_rank, dropped) == pytest.approx(5 * 2 * 32 / 5.0)
    # the plain window would end at the late worker's last record (4.5) and count its samples
    assert throughput(per_rank) != pytest.approx(64.0)
