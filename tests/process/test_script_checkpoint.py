"""A DDP script's own checkpoint, on every engine: convnet_ddp.py with AdamW saves its
model, optimizer, schedule and step after 4 of 8 steps under torchrun, and logs a loss
averaged by dist.all_reduce; convnet_psar.py (the diff in docs/your-own-script.md) does the
same under `psar launch`. On allreduce, ddp and ps-sync the checkpoint is torchrun's, the
run resumed from it ends where torchrun's whole run ends, and so does the whole run (float64,
1e-10). Before: under ps-sync job.optimizer.state_dict() held no state, loading one changed
nothing, and the resumed run ended 8.7e-2 away."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import max_param_diff

from tests.process.test_ddp_contract import launched, torchrun_ddp

ARGS = ["--float64", "--optimizer", "adamw", "--lr", "0.01", "--steps", "8"]


def mean_loss(log: str) -> str:
    return re.search(r"rank 0: 8 steps, mean loss (\S+)", log).group(1)


def same_checkpoint(ours: dict, torchs: dict) -> float:
    """The largest difference between two checkpoints of the script, which must otherwise
    hold the same things: model, optimizer groups and state slots, schedule, step."""
    assert ours["step"] == torchs["step"] and ours["scheduler"] == torchs["scheduler"]
    assert ours["optimizer"]["param_groups"] == torchs["optimizer"]["param_groups"]
    state, expected = ours["optimizer"]["state"], torchs["optimizer"]["state"]
    assert {i: sorted(s) for i, s in state.items()} == {i: sorted(s) for i, s in expected.items()}
    return max([max_param_diff(ours["model"], torchs["model"])]
               + [(state[i][slot].double() - value.double()).abs().max().item()
                  for i, entry in expected.items() for slot, value in entry.items()])


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_ddp_scripts_own_checkpoint_resumes_to_torchruns_parameters_on_every_engine(tmp_path):
    reference = torchrun_ddp(ARGS + ["--save-at", "4", "--save", str(tmp_path / "torchrun.ckpt")], tmp_path)
    checkpoint = torch.load(tmp_path / "torchrun.ckpt", weights_only=True)
    assert all(float(s["step"]) == 4 for s in checkpoint["optimizer"]["state"].values())
    loss = mean_loss((tmp_path / "torchrun.log").read_text())
    for engine in ("allreduce", "ddp", "ps-sync"):
        mine = tmp_path / f"{engine}.ckpt"
        whole = launched(engine, ARGS + ["--save-at", "4", "--save", str(mine)], tmp_path / engine)
        assert max_param_diff(reference, whole) < 1e-10, engine
        assert same_checkpoint(torch.load(mine, weights_only=True), checkpoint) < 1e-10, engine
        resumed = launched(engine, ARGS + ["--resume", str(mine)], tmp_path / f"{engine}-resumed")
        assert max_param_diff(reference, resumed) < 1e-10, engine
        for run in (engine, f"{engine}-resumed"):  # the script's own dist.all_reduce of its loss
            assert mean_loss((tmp_path / run / "logs" / "rank0.log").read_text()) == loss, run


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_under_zero_the_scripts_checkpoint_is_torchruns_with_zero_redundancy_and_resumes_on_every_stage(tmp_path):
    """The script consolidates the optimizer on every rank (as torch's ZeroRedundancyOptimizer
    asks) and rank 0 saves: under zero each stage's file is torchrun's with
    ZeroRedundancyOptimizer, whose state is the plain AdamW's, and the run resumed from it ends
    at torchrun's parameters (stages 2 and 3)."""
    args = ARGS + ["--zero-redundancy"]
    reference = torchrun_ddp(args + ["--save-at", "4", "--save", str(tmp_path / "torchrun.ckpt")], tmp_path)
    checkpoint = torch.load(tmp_path / "torchrun.ckpt", weights_only=True)
    for stage in (1, 2, 3):
        mine, set_stage = tmp_path / f"zero{stage}.ckpt", (f"zero.stage={stage}",)
        whole = launched("zero", ARGS + ["--save-at", "4", "--save", str(mine)], tmp_path / f"zero{stage}",
                         overrides=set_stage)
        assert max_param_diff(reference, whole) < 1e-10, stage
        assert same_checkpoint(torch.load(mine, weights_only=True), checkpoint) < 1e-10, stage
        if stage == 1:  # its pieces' state is cut and put together as stage 2's
            continue
        resumed = launched("zero", ARGS + ["--resume", str(mine)], tmp_path / f"zero{stage}-resumed",
                           overrides=set_stage)
        assert max_param_diff(reference, resumed) < 1e-10, stage
