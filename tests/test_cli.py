"""The command line, through click's CliRunner and, for launchers, real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from experiments.cli import main
from experiments.launcher import free_port
from experiments.presets import PRESETS, build_config

RECORD_FIELDS = {"step", "time", "loss", "samples", "compute_s", "comm_s", "bytes_sent", "bytes_recv"}
SUMMARY_FIELDS = {"experiment", "engine", "workers", "steps", "seed", "final_loss", "eval",
                  "samples_per_sec", "wall_s", "bytes_per_worker_per_step", "param_sha256"}


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_list_names_every_experiment_and_engine():
    result = invoke("list")
    assert result.exit_code == 0
    for name in list(PRESETS) + ["local", "ddp", "allreduce"]:
        assert name in result.output


@pytest.mark.parametrize("args,message", [
    (["run", "quickstart", "--set", "nope=1"], "unknown key 'nope'"),
    (["run", "quickstart", "--set", "optim.lr=fast"], "expected a number"),
    (["run", "quickstart", "--engine", "teleport"], "Invalid value for '--engine'"),
    (["run", "imagenet"], "'imagenet' is not one of"),
    (["compare", "quickstart", "--engines", "ddp,teleport"], "unknown engine(s) teleport"),
    (["compare", "quickstart", "--workers", "1,two"], "comma-separated"),
])
def test_bad_input_is_one_clear_line(args, message):
    result = invoke(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def _check_run_dir(run_dir: Path, experiment: str, engine: str, workers: int, steps: int):
    assert (run_dir / "config.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_FIELDS <= summary.keys()
    assert (summary["experiment"], summary["engine"], summary["workers"], summary["steps"]) == (
        experiment, engine, workers, steps)
    for rank in range(workers if engine != "local" else 1):
        records = [json.loads(line) for line in (run_dir / f"metrics/rank{rank}.jsonl").read_text().splitlines()]
        assert len(records) == steps and RECORD_FIELDS <= records[0].keys()
    state = torch.load(run_dir / "model.pt", weights_only=True)
    expected = build_config(experiment).model.build().state_dict().keys()
    assert list(state.keys()) == list(expected)  # the bare model's keys, no "module." prefix
    return summary


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_run_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    result = invoke("run", "cnn", "--engine", "ddp", "--workers", 2, "--steps", 4, "--out", out)
    assert result.exit_code == 0, result.output
    assert f"run directory: {out}" in result.output
    summary = _check_run_dir(out, "cnn", "ddp", 2, 4)
    assert summary["bytes_per_worker_per_step"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_failing_worker_is_named_without_traceback(tmp_path):
    result = invoke("run", "quickstart", "--steps", 2, "--set", "batch_size=100000", "--out", tmp_path / "r")
    assert result.exit_code != 0
    assert re.search(r"rank [01] exited with code 1: psar: rank [01] failed: ValueError", result.output)
    assert "batch" in result.output.lower()
    assert "Traceback" not in result.output


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_torchrun_launches_the_worker_entry_point(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "experiments.cli", "worker",
           "quickstart", "--engine", "allreduce", "--steps", "5", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    _check_run_dir(out, "quickstart", "allreduce", 2, 5)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_worker_reads_rank_and_world_from_the_environment(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = invoke("worker", "quickstart", "--engine", "allreduce", "--steps", 3, "--out",
                    tmp_path / "w", env=env)
    assert result.exit_code == 0, result.output
    _check_run_dir(tmp_path / "w", "quickstart", "allreduce", 1, 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_curve_keys_and_an_encrypted_run(tmp_path):
    result = invoke("keys", tmp_path / "keys", "--workers", "worker")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "keys/allowed/worker.key").exists()
    result = invoke("run", "quickstart", "--engine", "ps-sync", "--steps", 5, "--curve",
                    tmp_path / "keys", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "run/config.json").read_text())
    assert saved["ps"]["curve_dir"] == str((tmp_path / "keys").resolve())
    _check_run_dir(tmp_path / "run", "quickstart", "ps-sync", 2, 5)
