"""Checkpoint and resume: a run stopped at a checkpoint and resumed ends with the same
parameters (float64, bit for bit here) as one that never stopped, for every engine family."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import max_param_diff
from experiments.rundir import checkpoint
from experiments.runtime.launcher import launch
from experiments.settings.presets import build_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

SETTINGS = ("dtype=float64", "threads=1", "checkpoint.every=5")
# cnn has BatchNorm buffers, which must come back too; quickstart keeps the rest cheap.
ENGINES = {"allreduce": ("cnn", {}), "ddp": ("quickstart", {}), "local": ("quickstart", {}),
           "ps-sync": ("cnn", {"servers": 2}), "zero": ("cnn", {}), "zero3": ("cnn", {}),
           "gossip": ("quickstart", {"workers": 4})}
# gossip: each worker's own model and optimizer, and the one-peer graph's schedule, go on
OWN = {"zero": ("zero.stage=2",), "zero3": ("zero.stage=3", "zero.algorithm=ring"),
       "gossip": ("gossip.topology=one-peer-exponential",)}


def POOL_JOBS() -> dict[str, dict]:
    jobs = {}
    for name, (experiment, extra) in ENGINES.items():
        settings, engine = SETTINGS + OWN.get(name, ()), "zero" if name == "zero3" else name
        jobs[f"{name}-full"] = dict(experiment=experiment, engine=engine, steps=12, overrides=settings, **extra)
        # Stopped after step 7 (its last checkpoint is step 5), then resumed to step 12.
        jobs[f"{name}-cut"] = dict(experiment=experiment, engine=engine, steps=7, resume_steps=12,
                                   overrides=settings, **extra)
    return jobs


@pytest.fixture(scope="module")
def resumed(pool):
    return pool.folder(__name__), pool.results(__name__)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_resumed_run_matches_uninterrupted(resumed, engine):
    root, results = resumed
    _, full = results[f"{engine}-full"]
    state = torch.load(root / f"{engine}-cut/model.pt", weights_only=True)
    assert max_param_diff(full, state) < 1e-10
    summary = json.loads((root / f"{engine}-cut/summary.json").read_text())
    assert summary["steps"] == 12
    # Steps 5 and 6 were redone after the resume: each step is recorded once.
    steps = [json.loads(line)["step"] for line in (root / f"{engine}-cut/metrics/rank0.jsonl").read_text().splitlines()]
    assert steps == list(range(12))


@pytest.mark.parametrize("name", ("zero", "zero3"))
def test_a_zero_checkpoint_is_an_all_reduce_checkpoint(resumed, name):
    """Each rank's file holds the whole model and optimizer state in torch's layout, put
    together from every rank's pieces: the file allreduce writes at the same step (10)."""
    root, _ = resumed
    for rank in (0, 1):
        ours = checkpoint.load(root / f"{name}-cut" / checkpoint.CHECKPOINT_DIR / f"rank{rank}.pt")
        theirs = checkpoint.load(root / "allreduce-cut" / checkpoint.CHECKPOINT_DIR / "rank0.pt")
        assert ours["step"] == theirs["step"] == 10
        assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
        assert max_param_diff(ours["model"], theirs["model"]) < 1e-10
        state, expected = ours["optimizer"]["state"], theirs["optimizer"]["state"]
        assert {i: sorted(s) for i, s in state.items()} == {i: sorted(s) for i, s in expected.items()} != {}
        assert max((state[i][k] - v).abs().max().item() for i, entry in expected.items() for k, v in entry.items()
                   if k != "step") < 1e-10


def test_checkpoints_are_written_atomically(resumed):
    root, _ = resumed
    folder = root / "ps-sync-cut" / checkpoint.CHECKPOINT_DIR
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["rank0.pt", "rank1.pt", "server0.pt", "server1.pt"]  # no temporary left
    state = checkpoint.load(folder / "server0.pt")
    assert state["version"] == 10 and state["optimizer"] is not None


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint.every"):
        checkpoint.load(tmp_path / "nothing.pt")


def test_resume_without_checkpoints_changes_nothing(tmp_path):
    cfg = build_config("quickstart", engine="ps-sync", steps=4)
    (tmp_path / "logs").mkdir()
    (tmp_path / "config.json").write_text("the first run's config")
    (tmp_path / "logs/rank0.log").write_text("the first run's log")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint .*rank0.pt, .*rank1.pt, .*server0.pt"):
        launch(cfg, tmp_path, resume=True)
    assert (tmp_path / "config.json").read_text() == "the first run's config"
    assert (tmp_path / "logs/rank0.log").read_text() == "the first run's log"
