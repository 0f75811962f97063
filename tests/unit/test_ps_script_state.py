"""A script's own checkpoint under the parameter servers (ps/script_state.py): job.optimizer's
state_dict() is the state torch's optimizer has after the same steps, put together from the
shards' keys in torch's layout, and load_state_dict() puts a file's state back on the shards,
so a run resumed from its own checkpoint ends where the uninterrupted run ends (float64).
Real shards in threads (ps.local.LocalCluster, inproc://); a parameter spans both shards."""

from __future__ import annotations

import threading

import pytest
import torch

from ps.config import PSConfig
from ps.easgd import EASGDEngine
from ps.engine import PSEngine
from ps.layout import ParamSpec, build_layout
from ps.local import LocalCluster

pytestmark = pytest.mark.timeout(60)
FAST = dict(timeout_s=5.0, heartbeat_s=0.05, worker_timeout_s=2.0)
OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


def net(values=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).double()
    if values is not None:
        model.load_state_dict(values)
    return model


def batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randn(4, 3, generator=gen, dtype=torch.float64)


def loss_of(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.mse_loss(model(x), y)


def reference(make, steps: int, workers: int):
    """torch alone: the mean of the workers' gradients, the optimizer's step; (model, optimizer)."""
    model = net()
    opt = make(list(model.parameters()))
    for step in range(steps):
        grads = []
        for rank in range(workers):
            model.zero_grad()
            loss_of(model, step, rank).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs) / workers
        opt.step()
    return model, opt


def psar_run(make, mode, steps, workers=1, start=0, checkpoint=None, at=None, engine=PSEngine, late=None):
    """`workers` engines in threads on two shards: from checkpoint (model before attach, its
    optimizer state after, every worker as a script does) or afresh, steps start..steps-1
    (late: a model state each worker loads after attach and after its first step);
    worker 0's (model state, job.optimizer.state_dict()) after step `at` (if given) and at the end."""
    models = [net(checkpoint["model"] if checkpoint else None) for _ in range(workers)]
    layout = build_layout([ParamSpec.of(n, p) for n, p in models[0].named_parameters()], 2, 20)
    config = PSConfig(**FAST)
    saved = {}
    with LocalCluster(layout, [p.detach().clone() for p in models[0].parameters()], make, mode, workers,
                      config) as cluster:
        extra = {"forward_loads": False} if engine is EASGDEngine else {"mode": mode, "forward_loads": False}
        engines = [engine(w, workers, torch.device("cpu"), cluster.addresses, config=config, **extra)
                   for w in range(workers)]
        errors = []

        def work(w):
            try:
                e, model = engines[w], models[w]
                e.attach(model, make)
                e.use_schedule(make([p for p in model.parameters()]))
                e.allow_clip()
                if checkpoint:
                    e.schedule.load_state_dict(checkpoint["optimizer"])
                for step in range(start, steps):
                    if late is not None and step in (start, start + 1):
                        model.load_state_dict(late)
                    e.backward(loss_of(model, step, w))
                    e.step()
                    if w == 0 and step + 1 in (at, steps):
                        saved[step + 1] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                                           "optimizer": e.schedule.state_dict()}
                e.close()
            except BaseException as err:  # noqa: BLE001 - raised below
                errors.append(err)
                engines[w].client.close()

        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert not any(t.is_alive() for t in threads), "a worker hung"
        if errors:
            raise errors[0]
    return saved


def assert_same_state(ours: dict, torchs: dict, tol: float = 1e-12) -> None:
    assert ours["param_groups"] == torchs["param_groups"]
    assert sorted(ours["state"]) == sorted(torchs["state"])
    for i, entry in torchs["state"].items():
        assert sorted(ours["state"][i]) == sorted(entry)
        for slot, value in entry.items():
            assert ours["state"][i][slot].shape == value.shape and ours["state"][i][slot].dtype == value.dtype
            assert (ours["state"][i][slot].double() - value.double()).abs().max().item() <= tol, (i, slot)


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_state_dict_is_torchs_and_a_resumed_run_ends_where_the_whole_one_does(name):
    make = OPTIMIZERS[name]
    model, opt = reference(make, 6, 2)
    whole = psar_run(make, "sync", 6, workers=2, at=3)
    assert_same_state(whole[6]["optimizer"], opt.state_dict())  # a parameter's keys, put together
    assert max_diff(whole[6]["model"], model.state_dict()) < 1e-12
    resumed = psar_run(make, "sync", 6, workers=2, start=3, checkpoint=whole[3])
    assert max_diff(resumed[6]["model"], whole[6]["model"]) == 0.0
    assert_same_state(resumed[6]["optimizer"], whole[6]["optimizer"], tol=0.0)


def test_torchs_own_file_loads_on_the_shards_and_one_async_worker_resumes_exactly():
    make = OPTIMIZERS["adamw"]
    half_model, half_opt = reference(make, 3, 1)
    model, _ = reference(make, 6, 1)
    resumed = psar_run(make, "async", 6, start=3, checkpoint={"model": half_model.state_dict(),
                                                             "optimizer": half_opt.state_dict()})
    assert max_diff(resumed[6]["model"], model.state_dict()) < 1e-12


def test_what_the_shards_cannot_resume_is_refused_by_name():
    make = OPTIMIZERS["adamw"]
    _, opt = reference(make, 1, 1)
    state = {"model": net().state_dict(), "optimizer": opt.state_dict()}
    with pytest.raises(NotImplementedError, match="under ps-async with 2 workers"):
        psar_run(make, "async", 1, workers=2, checkpoint=state)
    with pytest.raises(NotImplementedError, match="under ps-easgd"):
        psar_run(lambda p: torch.optim.SGD(p, lr=1.0), "async", 1, checkpoint=state, engine=EASGDEngine)
    with pytest.raises(RuntimeError, match=r"the values of 0.weight, 0.bias, 2.weight, 2.bias changed after "
                                           r"job.attach\(\) or job.step\(\) \(model.load_state_dict"):
        psar_run(make, "sync", 2, late=state["model"])
    other = torch.optim.AdamW(net().parameters(), lr=0.05, weight_decay=0.5).state_dict()
    with pytest.raises(ValueError, match=r"weight_decay=0.5 \(the shards run 0.1\)"):
        psar_run(make, "sync", 1, checkpoint={"model": state["model"], "optimizer": other})


# -- on the wire (ps/protocol_state.py): a shard's state and load, checked before they touch it

def _shard(mode="sync", workers=2):
    from ps.protocol import decode, encode
    from tests.unit.test_ps_server import LAYOUT, make
    server, _ = make(mode, workers, optimizer=lambda p: torch.optim.Adam(p, lr=0.1))

    def call(server, worker, op, tensors=None, **fields):
        replies = server.handle(f"w{worker}".encode(), encode({"op": op, "worker": worker, "req": 1, **fields}, tensors))
        return [decode(frames, LAYOUT) for _, frames in replies]
    return server, LAYOUT, call


def test_a_shards_state_goes_out_and_comes_back_as_it_was():
    from ps.protocol_state import state_fields
    server, layout, call = _shard(workers=1)
    keys = [k.id for k in layout.keys]
    grads = {k: torch.full((layout.keys[k].numel,), 0.5, dtype=torch.float64) for k in keys}
    call(server, 0, "push", [grads[k] for k in keys], step=0, version=0, keys=keys)
    got = call(server, 0, "state", keys=keys)[0]
    assert got.op == "ok" and [sorted(n) for n in got.get("slots")] == [["exp_avg", "exp_avg_sq", "step"]] * len(keys)
    state = {k: server.optimizer.slots(k) for k in keys}
    for k, names, tensors in zip(keys, got.get("slots"), got.parts):
        assert all(torch.equal(t, dict(state[k])[n]) for n, t in zip(names, tensors))
    zeroed = {k: [(n, torch.zeros_like(t)) for n, t in state[k]] for k in keys}
    fields, frames = state_fields([zeroed[k] for k in keys])
    assert call(server, 0, "load", frames, keys=keys, **fields)[0].op == "ok"
    assert all(float(t.abs().sum()) == 0 for k in keys for _, t in server.optimizer.slots(k))


@pytest.mark.parametrize("change, error", [
    (lambda f, fr: f["slots"][0].__setitem__(0, "velocity"), "optimizer state slot 'velocity'"),
    (lambda f, fr: f["shapes"].__setitem__(0, [3]), "is 'float64' [3]; expected float64"),
    (lambda f, fr: f["dtypes"].__setitem__(0, "float32"), "is 'float32'"),
    (lambda f, fr: fr.pop(), "tensor frame(s); expected equal counts"),
    (lambda f, fr: f["slots"].pop(), "header field 'slots' has 3 entries for 4 keys"),
])
def test_a_malformed_load_is_refused_naming_what_does_not_fit_and_changes_nothing(change, error):
    from ps.protocol_state import state_fields
    server, layout, call = _shard(workers=1)
    keys = [k.id for k in layout.keys]
    fields, frames = state_fields([[("exp_avg", torch.ones(layout.keys[k].numel, dtype=torch.float64)),
                                    ("step", torch.tensor(1.0))] for k in keys])
    change(fields, frames)
    reply = call(server, 0, "load", frames, keys=keys, **fields)[0]
    assert reply.op == "error" and error in reply.get("error")
    assert all(server.optimizer.slots(k) == [] for k in keys)
    assert server.counters["malformed"] == 1


def test_a_load_from_another_worker_or_under_async_with_several_is_refused():
    from ps.protocol_state import state_fields
    server, layout, call = _shard(workers=2)
    keys = [k.id for k in layout.keys]
    fields, frames = state_fields([[] for _ in keys])
    assert "worker 0, not worker 1" in call(server, 1, "load", frames, keys=keys, **fields)[0].get("error")
    server, layout, call = _shard("async", workers=2)
    assert "under async with 2 workers" in call(server, 0, "load", frames, keys=keys, **fields)[0].get("error")
    assert "optimizer state given for keys [0]" in call(_shard(workers=1)[0], 0, "load", frames[:0], keys=keys[:1],
                                                        slots=[[]], dtypes=[], shapes=[])[0].get("error")
