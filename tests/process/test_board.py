"""TensorBoard event files: written live by each rank of a ps-sync and an allreduce run, and by
`psar tensorboard` from finished run directories; read back with TensorBoard's own reader.
Without the tensorboard package, asking for them is one clear line."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from experiments.rundir import tensorboard_log as board
from experiments.cli import main

pytestmark = [pytest.mark.timeout(300)]
needs_tb = pytest.mark.skipif(board.available() is not None, reason="the tensorboard extra is not installed")
STEPS = 6


def _scalars(folder) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def POOL_JOBS() -> dict[str, dict]:
    if board.available() is not None:
        return {}
    return {e: dict(experiment="quickstart", engine=e, steps=STEPS, overrides=("tensorboard=true",))
            for e in ("ps-sync", "allreduce")}


@needs_tb
@pytest.mark.multiprocess
def test_live_event_files_and_the_converted_ones_hold_every_step(pool):
    tmp_path = pool.folder(__name__)
    for engine, name in (("ps-sync", "quickstart_ps-sync_x2_s1"), ("allreduce", "quickstart_allreduce_x2")):
        folder = tmp_path / engine / "tensorboard" / name
        for rank in (0, 1):
            tags = _scalars(folder / f"rank{rank}")
            for tag in ("train/loss", "train/samples_per_sec", "time/compute_s", "time/comm_s",
                        "traffic/bytes_sent", "traffic/bytes_recv"):
                assert tags[tag] == list(range(STEPS)), (engine, rank, tag)
        rank0 = _scalars(folder / "rank0")
        assert rank0["eval/accuracy"] == [STEPS - 1]
        if engine == "ps-sync":
            assert rank0["server0/updates"] == [STEPS - 1] and "staleness/mean" in rank0
            shard = _scalars(folder / "server0")  # the shard's own, from its serve loop
            assert shard["shard/updates"][-1] == STEPS and "shard/lost_workers" in shard
    # The same from the finished run directory, by `psar tensorboard` on the folder of runs.
    shutil.rmtree(tmp_path / "ps-sync" / "tensorboard")
    result = CliRunner().invoke(main, ["tensorboard", str(tmp_path)])
    assert result.exit_code == 0, result.output
    converted = _scalars(tmp_path / "ps-sync/tensorboard/quickstart_ps-sync_x2_s1/rank1")
    assert converted["train/loss"] == list(range(STEPS))


def test_without_the_extra_it_is_one_line(monkeypatch, tmp_path):
    def missing():
        raise RuntimeError(board.NEEDS)

    monkeypatch.setattr(board, "_summary_writer", missing)
    result = CliRunner().invoke(main, ["run", "quickstart", "--tensorboard", "--out", str(tmp_path / "r")])
    assert result.exit_code == 1 and "pip install 'psar[tensorboard]'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r").exists()


def test_run_names_say_experiment_engine_workers_servers_and_network():
    cfg = {"experiment": "mlp-mid", "engine": "ps-sync", "workers": 4, "servers": 2,
           "net": {"rate": "200mbit", "placement": "separate"}}
    assert board.run_name(cfg) == "mlp-mid ps-sync x4 s2 200mbit separate"
    assert board.run_name({"experiment": "cnn", "engine": "allreduce", "workers": 2, "net": {"rate": ""}}) == \
        "cnn allreduce x2"
