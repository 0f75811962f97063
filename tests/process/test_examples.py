"""The example scripts of experiments/examples/, run for a few steps through `psar launch`
as a user types it (a subprocess, in its own session so that a hang is ended whole).

gpt_psar.py trains under the command its docstring gives. convnet_ddp.py is plain DDP,
meant for torchrun (tests/process/test_ddp_contract.py runs it so and compares it with
convnet_psar.py, whose own runs are in tests/process/test_launch.py): under `psar launch` it trains
all the same, and the launcher then says what it lacks to make a run of it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.rundir.metrics import param_sha256
from experiments.workloads.models import GPTConfig

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "experiments" / "examples"
DEADLINE_S = 120


def psar_launch(*args: str, env: dict | None = None) -> tuple[int, str]:
    """`psar launch ARGS`: (exit code, output). Past the deadline the launcher and every
    process it started are killed and the test fails."""
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "launch", *args], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"psar launch {' '.join(args)} did not end within {DEADLINE_S} s:\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def records(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(DEADLINE_S + 30)
def test_gpt_psar_trains_on_the_parameter_server(tmp_path):
    run_dir, steps = tmp_path / "gpt", 3
    code, out = psar_launch("--engine", "ps-async", "--workers", "2", "--out", str(run_dir),
                            str(EXAMPLES / "gpt_psar.py"), "--steps", str(steps), "--batch-size", "4")
    assert code == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["experiment"] == "script:gpt_psar.py" and summary["engine"] == "ps-async"
    assert summary["workers"] == 2 and summary["steps"] == steps
    test_loss = summary["eval"]["test_loss"]  # the script's evaluate, run by job.close
    assert math.isfinite(test_loss) and test_loss < math.log(GPTConfig().vocab_size)
    assert f"final loss {summary['final_loss']:.3f}, test loss {test_loss:.3f} after {steps} steps" in out
    # Both workers trained every step on finite losses, and the loss fell from ln(vocab).
    losses = {rank: [r["loss"] for r in records(run_dir, rank)] for rank in (0, 1)}
    assert all(len(ls) == steps and all(map(math.isfinite, ls)) for ls in losses.values()), losses
    assert abs(losses[0][0] - math.log(GPTConfig().vocab_size)) < 0.5
    assert summary["final_loss"] < losses[0][0] - 0.2, losses
    # One shard applied every push of both workers, each worker at clock `steps`.
    (shard,) = summary["server_stats"]
    assert shard["joined_workers"] == [0, 1] and shard["clocks"] == {"0": steps, "1": steps}
    assert shard["updates"] == shard["pushes"] > 0 and shard["rejected"] == 0
    # model.pt holds the final parameters under the model's own names, trained and finite.
    state = torch.load(run_dir / "model.pt", weights_only=True)
    torch.manual_seed(0)
    model = GPTConfig().build()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert state.keys() == initial.keys()
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    moved = [k for k in initial if initial[k].is_floating_point() and not torch.equal(initial[k], state[k])]
    assert len(moved) > len(initial) // 2, moved
    model.load_state_dict(state)
    assert param_sha256(model) == summary["param_sha256"]


@pytest.mark.timeout(DEADLINE_S + 30)
def test_convnet_ddp_trains_under_psar_launch_which_asks_for_job_close(tmp_path):
    run_dir, saved = tmp_path / "convnet", tmp_path / "convnet.pt"
    code, out = psar_launch("--engine", "ddp", "--workers", "2", "--out", str(run_dir),
                            str(EXAMPLES / "convnet_ddp.py"), "--steps", "2", "--float64",
                            env={"CONVNET_OUT": str(saved)})
    # The script ran as under torchrun: both ranks joined, rank 0 trained 2 steps and saved.
    line = next((ln for ln in out.splitlines() if ln.startswith("rank 0: 2 steps, mean loss")), None)
    assert line is not None, out
    assert math.isfinite(float(line.rsplit(" ", 1)[1]))
    state = torch.load(saved, weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "4.weight", "4.bias"}  # the module's, not DDP's, names
    assert all(v.dtype == torch.float64 and torch.isfinite(v).all() for v in state.values())
    # But it is no psar run: the launcher says so in one line, naming what is missing.
    assert code != 0
    assert "rank 0 wrote no" in out and "summary.json" in out and "job.close()" in out, out
    assert "Traceback" not in out
    assert not (run_dir / "summary.json").exists()
