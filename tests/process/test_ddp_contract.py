"""A DDP script's gradient clipping, learning-rate schedule and accumulation over two
micro-batches (no_sync) behave on psar's engines as under torchrun DDP, or stop the run with
the reason: experiments/examples/convnet_ddp.py under torchrun and convnet_psar.py (the
diff in docs/your-own-script.md) under `psar launch`, float64.

Before: allreduce read the gradients while they were still being all-reduced (four runs,
four results), ps-sync dropped the clip and the scheduler without a word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import max_param_diff, started

from experiments.api import script_config
from experiments.runtime.launcher import LaunchError, launch_batch
from experiments.runtime.sites import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "experiments" / "examples"
CLIPPED = ["--float64", "--steps", "8", "--clip", "0.05", "--lr-step", "3", "--micro", "2"]
SCHEDULED = ["--float64", "--steps", "8", "--lr-step", "3", "--micro", "2"]


def torchrun_ddp(args, tmp_path: Path) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "ddp.pt"
    proc = started(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         "-m", "experiments.examples.convnet_ddp", *args], cwd=ROOT, env=dict(os.environ, CONVNET_OUT=str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    output, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, output
    (tmp_path / "torchrun.log").write_text(output)
    return torch.load(out, weights_only=True)


def launched(engine: str, args, run_dir: Path, **extra) -> dict:
    """The parameters the script saves, model.state_dict() of the module attach() returned;
    they are the run's model.pt too, key for key."""
    script = EXAMPLES / "convnet_psar.py"
    cfg = script_config(str(script), args, engine=engine, workers=2, **extra)
    saved = run_dir / "script.pt"
    os.environ["CONVNET_OUT"] = str(saved)
    try:
        launch_batch([(cfg, run_dir)], deadline_s=150, quiet=True, script=[str(script), *args])
    finally:
        del os.environ["CONVNET_OUT"]
    state = torch.load(saved, weights_only=True)
    assert max_param_diff(state, torch.load(run_dir / "model.pt", weights_only=True)) == 0
    return state


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory) -> dict:
    """torchrun DDP's parameters after the clipped script, which both tests below compare with."""
    return torchrun_ddp(CLIPPED, tmp_path_factory.mktemp("torchrun-clipped"))


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_clip_and_schedule_end_as_under_torchrun_ddp(tmp_path, clipped_reference):
    reference = clipped_reference
    unclipped = torchrun_ddp(SCHEDULED, tmp_path / "plain")
    assert max_param_diff(reference, unclipped) > 1e-4  # the clip acts: the runs differ
    for engine in ("allreduce", "ddp"):
        state = launched(engine, CLIPPED, tmp_path / engine)
        assert list(state) == list(reference), engine  # torchrun's model.module.state_dict() keys
        assert max_param_diff(reference, state) < 1e-10, engine
    # Sums add up either way: what no_sync saves is the first micro-batch's all-reduce.
    records = [json.loads(line) for line in (tmp_path / "allreduce" / "metrics" / "rank0.jsonl").open()]
    assert {r["bytes_sent"] for r in records} == {sum(t.numel() * 8 for t in reference.values())}
    # The parameter server has the schedule (its learning rate travels with the pushes) ...
    assert max_param_diff(unclipped, launched("ps-sync", SCHEDULED, tmp_path / "ps", servers=2)) < 1e-10
    assert "lr_scheduler.step()" not in (tmp_path / "ps" / "logs" / "rank0.log").read_text()  # no false order warning
    # ... refuses torch's clip, which would act on a gradient already sent, naming what clips ...
    with pytest.raises(LaunchError) as err:
        launched("ps-sync", CLIPPED, tmp_path / "ps-clip", servers=2)
    assert "changed after backward pushed it" in str(err.value) and "job.clip_grad_norm_" in str(err.value)
    # ... and with job.clip_grad_norm_ the shards agree on the norm and clip as DDP does.
    clipped = launched("ps-sync", CLIPPED + ["--job-clip"], tmp_path / "ps-job-clip", servers=2)
    assert list(clipped) == list(reference) and max_param_diff(reference, clipped) < 1e-10
    # Compressed pushes and pulls (top-k of every entry: nothing left out, so nothing differs)
    # clip and schedule alike: each worker's own optimizer steps on the pulled gradient.
    squeezed = launched("ps-sync", CLIPPED + ["--job-clip"], tmp_path / "ps-topk", servers=2,
                        overrides=("compress.method=topk", "compress.ratio=1.0"))
    assert max_param_diff(reference, squeezed) < 1e-10


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_under_zero_job_clip_no_sync_and_schedule_end_as_under_torchrun_ddp_and_torchs_clip_is_stopped(
        tmp_path, clipped_reference):
    """Every stage clips by the norm of its sharded gradient (job.clip_grad_norm_), accumulates
    under job.no_sync and follows the schedule as DDP does; torch's own clip on the model under
    stage 1 would act on a gradient of which each rank has averaged only its pieces."""
    reference = clipped_reference
    for stage in (2, 3):  # stage 1 clips its pieces as stage 2 does
        state = launched("zero", CLIPPED + ["--job-clip"], tmp_path / f"zero{stage}", overrides=(f"zero.stage={stage}",))
        assert list(state) == list(reference) and max_param_diff(reference, state) < 1e-10, stage
    with pytest.raises(LaunchError) as err:
        launched("zero", CLIPPED, tmp_path / "zero-torch-clip", overrides=("zero.stage=1",))
    assert "changed after job.backward reduce-scattered it" in str(err.value) and "job.clip_grad_norm_" in str(err.value)


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_ten_runs_of_the_allreduce_clip_script_give_one_result(tmp_path):
    states = [launched("allreduce", CLIPPED, tmp_path / f"run{i}") for i in range(10)]
    assert all(max_param_diff(states[0], s) == 0 for s in states[1:])
