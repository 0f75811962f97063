"""The engine zero's checkpoint in torch's layout (allreduce/zero_state.py), on one rank in
this process: what consolidate_state_dict gathers is torch's own optimizer's state, a file
loads back into the pieces, and what cannot be is refused by name."""

from __future__ import annotations


import pytest
import torch

from allreduce.zero import ZeroEngine
from allreduce.zero_config import ZeroConfig
from experiments.runtime.sites import free_port


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    engines = []

    def make(stage: int, model: torch.nn.Module, optimizer=torch.optim.AdamW) -> ZeroEngine:
        engine = ZeroEngine(0, 1, torch.device("cpu"), ZeroConfig(stage=stage, bucket_mb=1e-4, first_bucket_mb=1e-4),
                            timeout_s=20)
        engines.append(engine)
        engine.attach(model, lambda params: optimizer(params, lr=0.01))
        return engine

    yield make
    for engine in engines:
        engine.close()


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()


def train(engine: ZeroEngine, model: torch.nn.Module, steps: int) -> None:
    for s in range(steps):
        x = torch.linspace(-1, 1, 10, dtype=torch.float64).view(2, 5) * (s + 1)
        engine.backward(model(x).pow(2).sum())
        engine.step()


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_the_consolidated_state_is_torchs_own_and_loads_back(group, stage):
    reference_model = net()
    reference = torch.optim.AdamW(reference_model.parameters(), lr=0.01)
    for s in range(3):
        x = torch.linspace(-1, 1, 10, dtype=torch.float64).view(2, 5) * (s + 1)
        reference_model(x).pow(2).sum().backward()
        reference.step()
        reference.zero_grad()
    model = net()
    engine = group(stage, model)
    train(engine, model, 3)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        engine.optimizer.state_dict()
    if stage == 3:
        with pytest.raises(RuntimeError, match="zero.stage=3 between steps"):
            model.state_dict()
    engine.optimizer.consolidate_state_dict(to=0)
    ours, torchs = engine.optimizer.state_dict(), reference.state_dict()
    assert ours["param_groups"] == torchs["param_groups"]
    assert {i: sorted(s) for i, s in ours["state"].items()} == {i: sorted(s) for i, s in torchs["state"].items()}
    assert max((ours["state"][i][k].double() - v.double()).abs().max().item()
               for i, entry in torchs["state"].items() for k, v in entry.items()) < 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(),
                                                         reference_model.state_dict().values())) < 1e-12
    engine.step()  # no gradient: nothing changes, but the consolidated state is gone with the step
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        engine.optimizer.state_dict()

    other = net()
    again = group(stage, other)
    again.optimizer.load_state_dict(torchs)
    again.optimizer.consolidate_state_dict(to=None)
    loaded = again.optimizer.state_dict()
    assert max((loaded["state"][i][k].double() - v.double()).abs().max().item()
               for i, entry in torchs["state"].items() for k, v in entry.items()) == 0


def test_a_file_zero_cannot_cut_is_refused_by_name(group):
    model = net()
    engine = group(2, model)
    reference_model = net()
    reference = torch.optim.AdamW(reference_model.parameters(), lr=0.01)
    reference_model(torch.ones(1, 5, dtype=torch.float64)).sum().backward()
    reference.step()
    state = reference.state_dict()
    with pytest.raises(ValueError, match="of 3 parameters; the model trains 4"):
        engine.optimizer.load_state_dict({**state, "param_groups": [{**state["param_groups"][0], "params": [0, 1, 2]}]})
    misshapen = {**state["state"], 0: {**state["state"][0], "exp_avg": torch.zeros(3, 3, dtype=torch.float64)}}
    with pytest.raises(ValueError, match="'exp_avg' neither shaped like each parameter nor one number"):
        engine.optimizer.load_state_dict({**state, "state": misshapen})
    with pytest.raises(ValueError, match="different slots"):
        engine.optimizer.load_state_dict({**state, "state": {**state["state"], 0: {"step": torch.tensor(1.0)}}})
    with pytest.raises(ValueError, match="consolidate_state_dict\\(to=2\\)"):
        engine.optimizer.consolidate_state_dict(to=2)
    engine.optimizer.consolidate_state_dict(to=0)
    assert engine.optimizer.state_dict()["state"] == {}  # nothing refused changed the pieces' state
