"""When a worker is slow or dies: backup workers, restart-all and rejoin, in float64.

- ps-sync with one backup worker, a worker stopped at step 0 (fault.pause_*): every step
  updates with the others' pushes and drops the late one; the parameters are local training
  over exactly the shards the shards counted in.
- allreduce and ddp with --max-restarts, a worker killed (fault.kill_*): every worker starts
  again from the shared checkpoint and ends bit for bit where an uninterrupted run does; the
  summary says what was lost and how long the restart took.
- ps-sync with --max-restarts: the dead worker alone starts again, rejoins the shard and is
  counted in from the next step; the parameters are local training over the shards each step
  counted in.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FIT_SCRIPT as SCRIPT, max_param_diff
from experiments.rundir.metrics import read_metrics
from experiments.runtime.launcher import launch
from experiments.settings.presets import build_config
from experiments.workloads.datasets import BatchFeeder
from experiments.workloads.tasks import get_task

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

F64 = ("dtype=float64", "threads=1")
DEADLINE_S = 150


def run(tmp_path, name, engine, workers, steps, overrides=(), **kw):
    cfg = build_config("quickstart", F64 + tuple(overrides), engine=engine, workers=workers, steps=steps,
                       servers=1 if engine.startswith("ps-") else None)
    summary = launch(cfg, tmp_path / name, deadline_s=DEADLINE_S, quiet=True, **kw)
    return cfg, summary, torch.load(tmp_path / name / "model.pt", weights_only=True)


def local_over(cfg, counted: list[list[int]]) -> dict[str, torch.Tensor]:
    """quickstart trained in one process, step s averaging the gradients of the shards
    counted[s] (as psar's loop builds model and data)."""
    dtype = cfg.torch_dtype
    dataset = cfg.data.build(cfg.seed)
    task = get_task(dataset.task)
    torch.manual_seed(cfg.seed)
    model = cfg.model.build().to(dtype=dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = cfg.optim.build(params)
    feeders = {r: BatchFeeder(dataset, r, cfg.workers, cfg.batch_size, cfg.seed, dtype, torch.device("cpu"))
               for r in range(cfg.workers)}
    for step, shards in enumerate(counted):
        for r in shards:
            inputs, targets = feeders[r].batch(step)
            task.loss(model(*inputs), targets).backward()
        with torch.no_grad():
            for p in params:
                p.grad.div_(len(shards))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in model.state_dict().items()}


def counted_in(run_dir, summary, steps: int) -> list[list[int]]:
    """The ranks each step of a one-shard ps-sync run counted in: those that recorded the
    step, less those whose push of it the shard dropped."""
    records = read_metrics(run_dir)
    dropped = {int(s): set(ws) for s, ws in summary["server_stats"][0]["dropped"].items()}
    return [sorted(r for r, recs in records.items() if any(x["step"] == s for x in recs) and r not in dropped.get(s, ()))
            for s in range(steps)]


def test_a_backup_worker_drops_the_stopped_workers_push_and_trains_on_the_others(tmp_path):
    steps = 6
    cfg, summary, state = run(tmp_path, "backup", "ps-sync", 3, steps, (
        "ps.backup_workers=1", "fault.pause_rank=2", "fault.pause_step=0", "fault.pause_s=3"))
    records = read_metrics(tmp_path / "backup")
    assert [r["step"] for r in records[0]] == list(range(steps))
    # It stopped at its first step (0, or a later one where the others had gone on before it
    # joined); its push of that step came seconds late: dropped, and it went on at the shards'
    # step. What each step counted in, the test reads off the shard.
    stopped = records[2][0]["step"]
    assert len(records[2]) < steps and summary["dropped_pushes"][stopped] == 1
    counted = counted_in(tmp_path / "backup", summary, steps)
    assert counted[stopped] == [0, 1] and all(len(c) >= 2 for c in counted)
    assert max_param_diff(state, local_over(cfg, counted)) < 1e-10
    fault = json.loads((tmp_path / "backup" / "logs" / "fault-rank2.json").read_text())
    assert fault["kind"] == "pause" and fault["resumed"] - fault["wall"] >= 3.0


@pytest.mark.parametrize("engine, own", [("allreduce", ()), ("ddp", ()), ("zero", ("zero.stage=2",))])
def test_a_killed_worker_restarts_every_worker_from_the_checkpoint(tmp_path, engine, own):
    steps, kill = 9, 6
    _, plain, state = run(tmp_path, "plain", engine, 2, steps, ("checkpoint.every=4",) + own)
    _, summary, restarted = run(tmp_path, "killed", engine, 2, steps, (
        "checkpoint.every=4", "fault.kill_rank=1", f"fault.kill_step={kill}") + own, max_restarts=2)
    assert summary["param_sha256"] == plain["param_sha256"]
    assert max_param_diff(state, restarted) == 0.0
    assert summary["restarts"] == 1 and summary["steps_lost"] == kill - 4
    (restart,) = summary["restart_log"]
    assert restart["ranks"] == [0, 1] and restart["reached_step"] == kill and restart["resumed_step"] == 4
    assert "rank 1 was killed by SIGKILL" in restart["failure"]
    parts = [restart[k] for k in ("process_start_s", "checkpoint_s", "rendezvous_s", "rest_s")]
    assert summary["recovery_s"] == restart["recovery_s"] > 0 and all(p >= 0 for p in parts[:3])
    assert sum(parts) == pytest.approx(restart["recovery_s"])
    for recs in read_metrics(tmp_path / "killed").values():  # the redone steps once each
        assert [r["step"] for r in recs] == list(range(steps))


def test_without_restarts_a_killed_worker_fails_the_run_naming_it(tmp_path):
    from experiments.runtime.launcher import LaunchError

    with pytest.raises(LaunchError, match="rank 1 was killed by SIGKILL"):
        run(tmp_path, "killed", "allreduce", 2, 6, ("fault.kill_rank=1", "fault.kill_step=2"))


def test_a_killed_ps_worker_rejoins_and_is_counted_in_from_the_next_step(tmp_path):
    steps, kill = 8, 4
    cfg, summary, state = run(tmp_path, "rejoin", "ps-sync", 3, steps, (
        "fault.kill_rank=1", f"fault.kill_step={kill}"), max_restarts=1)
    assert summary["restarts"] == 1 and summary["steps_lost"] == 0
    (restart,) = summary["restart_log"]
    assert restart["ranks"] == [1] and restart["reached_step"] == kill and restart["resumed_step"] >= kill
    assert summary["server_stats"][0]["rejoined_workers"] == [1]
    records = read_metrics(tmp_path / "rejoin")
    assert [r["step"] for r in records[0]] == list(range(steps))
    counted = counted_in(tmp_path / "rejoin", summary, steps)
    # rank 1 counted in until it died and again from the step the shard took it back at
    first = restart["resumed_step"]
    assert [1 in c for c in counted] == [s < kill or s >= first for s in range(steps)]
    assert max_param_diff(state, local_over(cfg, counted)) < 1e-10


@pytest.mark.parametrize("engine,extra", [("allreduce", []), ("ps-sync", ["--servers", "1"])])
def test_psar_launch_restarts_a_script_whose_worker_died(tmp_path, engine, extra):
    from click.testing import CliRunner

    from experiments.cli import main

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    common = ["launch", "--engine", engine, *extra, "--set", "timeout_s=20", "--set", "checkpoint.every=2"]

    def launch(name, *more):
        result = CliRunner().invoke(main, [*common, *more, "--out", str(tmp_path / name), str(script), "7"])
        assert result.exit_code == 0, result.output
        return json.loads((tmp_path / name / "summary.json").read_text())

    plain = launch("plain")
    killed = launch("killed", "--max-restarts", "1", "--set", "fault.kill_rank=1", "--set", "fault.kill_step=3")
    assert killed["restarts"] == 1
    if engine == "allreduce":  # every rank again from step 2's checkpoint: the same run
        assert killed["steps_lost"] == 1 and killed["param_sha256"] == plain["param_sha256"]
    else:  # rank 1 alone again, at the shard's step: nothing redone, and the steps it missed
        assert killed["steps_lost"] == 0 and killed["restart_log"][0]["resumed_step"] >= 3
