"""Adding an engine is one step: this file registers a toy engine, and nothing else in psar
changes. `psar run` trains with it (its worker processes import this file through
$PSAR_ENGINES), it agrees with the reference in float64, and `psar list`, the table, the
figures, the link model and the cost model all take it in from the registry alone.

The toy is the textbook data-parallel engine: after backward, one blocking all-reduce per
parameter (what DDP's buckets and psar's hooks exist to avoid)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from experiments.engines import PLUGINS_ENV, EngineSpec, register

TOY = "toy-naive"
HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


class NaiveAllReduce:
    """One all-reduce per gradient after backward, then the local optimizer."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        from allreduce.group import init_process_group

        init_process_group(device, rank, world, timeout_s)
        self.world, self.shards = world, [rank]

    def attach(self, model, make_optimizer):
        from allreduce.group import broadcast_tensors

        broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buffers = list(model.buffers())
        self.optimizer = make_optimizer(self._params)
        return model

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> dict:
        from allreduce.group import broadcast_tensors

        start, nbytes = time.perf_counter(), 0
        for p in self._params:
            dist.all_reduce(p.grad)
            p.grad.div_(self.world)
            nbytes += p.grad.numel() * p.grad.element_size()
        if self._buffers:  # rank 0's BatchNorm statistics, as the reference keeps shard 0's
            broadcast_tensors(self._buffers)
        comm_s = time.perf_counter() - start
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"comm_s": comm_s, "bytes_sent": nbytes, "bytes_recv": nbytes}

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        from allreduce.group import shutdown

        shutdown()


def build_toy(cfg, env, device, trace):
    return NaiveAllReduce(env.rank, env.world, device, cfg.timeout_s)


register(EngineSpec(TOY, "one blocking all-reduce per parameter after backward", f"{__name__}:build_toy",
                    "ring", "#e7ba52"))


def invoke(*args) -> str:
    from experiments.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def plugin_env(monkeypatch):
    """What a user sets: the module that registers the engine, importable by every process."""
    monkeypatch.setenv(PLUGINS_ENV, __name__)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def test_a_registered_engine_runs_and_every_analysis_takes_it_in(tmp_path, plugin_env):
    from analysis import plots, style
    from analysis.costmodel import CostModel, Fit, validate
    from analysis.linkmodel import link_time
    from analysis.results import family, load_run

    assert TOY in invoke("list")
    common = ("quickstart", "--workers", 2, "--steps", 4, "--set", "dtype=float64")
    invoke("run", *common, "--engine", TOY, "--out", tmp_path / "toy")
    invoke("run", *common, "--engine", "local", "--out", tmp_path / "local")

    toy, local = load_run(tmp_path / "toy"), load_run(tmp_path / "local")
    assert toy.label == TOY and family(toy.label) == "ring"
    mine, reference = (torch.load(r.path / "model.pt") for r in (toy, local))
    assert max((mine[k] - reference[k]).abs().max().item() for k in reference) < 1e-12

    table = invoke("table", tmp_path / "toy", tmp_path / "local")
    assert any(line.startswith(f"| {TOY} ") for line in table.splitlines())
    assert style.colour(TOY) == "#e7ba52"
    figures = plots.plot_all([toy, local], tmp_path / "figures")
    assert figures and all(path.exists() for path in figures)

    # The models price it as the family it registered: a ring all-reduce of M.
    fit = Fit(1e-4, 1e-9)
    model = CostModel(library=fit, ring=Fit(5e-4, 5e-9), ps=None)
    assert model.comm_time(TOY, 4, 1, 1e6, 2) == model.comm_time("allreduce/library", 4, 1, 1e6, 2) > 0
    assert link_time(TOY, 4, 1, 1e6, 1e9) == link_time("allreduce/library", 4, 1, 1e6, 1e9) > 0
    (row,) = validate(model, [toy])
    assert row["label"] == TOY and row["predicted_s"] > row["compute_s"] > 0


def test_an_engine_name_or_label_is_taken_once():
    with pytest.raises(ValueError, match="already registered"):
        register(EngineSpec(TOY, "another", "elsewhere:build", "ring", "#000000"))
    with pytest.raises(ValueError, match="allreduce/ring already belong"):
        from experiments.engines import Label

        register(EngineSpec("toy-2", "x", "elsewhere:build", "ring", "#000000",
                            variants=(Label("allreduce/ring", "#000000"),)))
    with pytest.raises(ValueError, match="family 'tree'"):
        register(EngineSpec("toy-3", "x", "elsewhere:build", "tree", "#000000"))
