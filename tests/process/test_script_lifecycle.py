"""A user's script gets the run lifecycle of the named experiments (experiments/harness/job.py):
checkpoints every checkpoint.every steps and `psar launch --resume`, from which the script's
loop starts at job.start_step and ends with the parameters (float64) of a run that never
stopped, every step recorded once; job.close(evaluate) puts the script's metrics in
summary.json; TensorBoard files when asked for.

Before: the object a script got re-implemented the loop's bookkeeping without any of these."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import FIT_SCRIPT as SCRIPT, max_param_diff

from experiments.rundir import tensorboard_log as board

from experiments.settings import config
from experiments.settings.script import script_config
from experiments.cli import main

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]



def launch(*argv: str) -> None:
    result = CliRunner().invoke(main, ["launch", *argv])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("engine,extra", [("allreduce", []), ("ps-sync", ["--servers", "1"])])
def test_a_resumed_script_ends_as_one_that_never_stopped(tmp_path, engine, extra):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    common = ["--set", "timeout_s=20", "--set", "checkpoint.every=2"]
    board_on = ["--set", "tensorboard=true"] if board.available() is None else []
    launch("--engine", engine, *extra, *common, *board_on, "--out", str(tmp_path / "whole"), str(script), "7")
    launch("--engine", engine, *extra, *common, "--out", str(tmp_path / "cut"), str(script), "5")
    # The cut run's last checkpoint is step 4: steps 4 to 6 run after the resume.
    launch("--resume", str(tmp_path / "cut"), "--out", str(tmp_path / "resumed"), str(script), "7")
    whole = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert max_param_diff(whole, cut) > 1e-3  # the runs differ until the resumed one catches up
    assert max_param_diff(whole, resumed) < 1e-12
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["engine"] == engine and summary["steps"] == 7
    assert summary["eval"]["weight_sum"] == pytest.approx(whole["0.weight"].sum().item(), abs=1e-12)
    for rank in (0, 1):
        records = (tmp_path / "resumed" / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in records] == list(range(7))
    if board_on:
        assert list((tmp_path / "whole" / "tensorboard").rglob("events.out.tfevents.*"))


def test_a_resume_names_what_is_missing_or_wrong(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    (tmp_path / "plain").mkdir()
    config.save(script_config(str(script), ["2"], engine="allreduce"), tmp_path / "plain" / "config.json")
    result = CliRunner().invoke(main, ["launch", "--resume", str(tmp_path / "plain"), "--out",
                                       str(tmp_path / "again"), str(script), "4"])
    assert result.exit_code != 0 and "checkpoint.every" in result.output, result.output
    assert not (tmp_path / "again").exists()
    other = tmp_path / "other.py"
    other.write_text(SCRIPT)
    result = CliRunner().invoke(main, ["launch", "--resume", str(tmp_path / "plain"), str(other), "4"])
    assert result.exit_code != 0 and "is a run of script:fit.py" in result.output, result.output
