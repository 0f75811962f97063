"""The shard's one optimizer over all its chunks, stepped over any subset: the same
arithmetic as one optimizer per key, in float64; the learning rate a push brings; its
checkpoint as per-key state dicts."""

from __future__ import annotations

import numpy
import pytest
import torch

from ps.shard import compiled
from ps.shard.optim import ShardOptimizer

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov-maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.3, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def chunks(seed: int) -> dict[int, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn(5 + k, dtype=torch.float64) for k in range(4)}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_steps_over_subsets_equal_one_optimizer_per_key(name):
    make = OPTIMIZERS[name]
    shard_chunks, own = chunks(0), chunks(0)
    shard = ShardOptimizer(make, shard_chunks)
    per_key = {k: make([t]) for k, t in own.items()}
    torch.manual_seed(1)
    for step, keys in enumerate([[0, 1, 2, 3], [1, 3], [0], [2, 3], [0, 1, 2, 3]]):
        grads = {k: torch.randn_like(own[k]) for k in keys}
        for k in keys:
            shard_chunks[k].grad, own[k].grad = grads[k].clone(), grads[k].clone()
            per_key[k].step()
        shard.step(keys)
        for k in keys:
            shard_chunks[k].grad = own[k].grad = None
    for k in own:  # keys left out of a step were not touched (Adam's bias correction per key too)
        assert torch.allclose(shard_chunks[k], own[k], rtol=0, atol=1e-13), (name, k)


def test_a_given_learning_rate_is_used_and_stays_the_groups():
    values = chunks(0)
    start = {k: t.clone() for k, t in values.items()}
    shard = ShardOptimizer(lambda ps: torch.optim.SGD(ps, lr=1.0), values)
    values[2].grad = torch.ones_like(values[2])
    shard.step([2], lr=0.25)
    assert torch.equal(values[2], start[2] - 0.25) and shard.lr == 0.25
    shard.step([2])  # as a scheduler leaves it: the last one given
    assert torch.equal(values[2], start[2] - 0.5)


def test_checkpoint_is_one_state_dict_per_key_and_loads_back():
    make = OPTIMIZERS["adam"]
    values = chunks(0)
    shard = ShardOptimizer(make, values)
    for k in values:
        values[k].grad = torch.ones_like(values[k])
    shard.step([0, 2])
    saved = shard.state_dict()
    assert set(saved) == set(values) and saved[1]["state"] == {} and saved[0]["state"][0]["step"] == 1
    again = ShardOptimizer(make, chunks(0))
    again.load_state_dict(saved)
    assert again.state_dict()[0]["state"][0]["exp_avg"].equal(saved[0]["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="optimizer state of keys"):
        again.load_state_dict({0: saved[0]})


def test_a_shard_builds_and_steps_its_optimizer_without_loading_the_compiler():
    """torch._dynamo costs a process as long as importing torch; a shard never compiles."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from ps.shard.optim import ShardOptimizer\n"
            "s = ShardOptimizer(lambda ps: torch.optim.Adam(ps, lr=0.1), {0: torch.zeros(4)})\n"
            "s.chunks[0].grad = torch.ones(4); s.step([0]); s.load_state_dict(s.state_dict())\n"
            "print('torch._dynamo' in sys.modules, float(s.chunks[0][0]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, value = out.stdout.split()
    assert loaded == "False" and abs(float(value) + 0.1) < 1e-6


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n.startswith("sgd")])
def test_sgd_is_replayed_bit_for_bit_with_torchs_state(name):
    """The shard runs SGD's arithmetic itself (ps.shard.optim.sgd_step): the same bits as
    torch.optim.SGD's own step, dense and row-sparse gradients, and the same state dict."""
    make = OPTIMIZERS[name]
    ours, theirs = chunks(0), chunks(0)
    ours[4] = torch.randn(6, 3, dtype=torch.float64)  # a row-sparse chunk
    theirs[4] = ours[4].clone()
    shard = ShardOptimizer(make, ours)
    assert shard._sgd
    reference = make(list(theirs.values()))
    torch.manual_seed(2)
    for keys in ([0, 1, 2, 3], [1, 3], [0, 4], [2, 3, 4], [0, 1, 2, 3, 4]):
        for k in keys:
            if k == 4:
                rows = torch.tensor([[0, 2, 5]])
                grad = torch.sparse_coo_tensor(rows, torch.randn(3, 3, dtype=torch.float64), (6, 3),
                                               check_invariants=True)
            else:
                grad = torch.randn_like(theirs[k])
            ours[k].grad, theirs[k].grad = grad.clone(), grad.clone()
        if "momentum" in name or "nesterov" in name or "dampening" in name:
            keys = [k for k in keys if k != 4]  # torch's SGD takes sparse gradients without momentum only
            ours[4].grad = theirs[4].grad = None
        shard.step(keys)
        reference.step()
        for t in (*ours.values(), *theirs.values()):
            t.grad = None
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), (name, k)
    mine, ref = shard.optimizer.state_dict(), reference.state_dict()
    assert set(mine["state"]) == set(ref["state"])
    for i, s in ref["state"].items():
        assert torch.equal(mine["state"][i]["momentum_buffer"], s["momentum_buffer"])


def test_after_a_checkpoint_is_loaded_a_pushs_learning_rate_is_still_used():
    """torch's load_state_dict puts a new parameter group in place: the learning rate a push
    brings goes to that one (it went to the former group, and the loaded lr stayed)."""
    values = chunks(0)
    saved = ShardOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.5), chunks(0)).state_dict()
    shard = ShardOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.01), values)
    shard.load_state_dict(saved)
    assert shard.lr == 0.5
    start = values[1].clone()
    values[1].grad = torch.ones_like(values[1])
    shard.step([1], lr=0.25)
    assert torch.equal(values[1], start - 0.25) and shard.lr == 0.25


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n.startswith("sgd")])
def test_gradients_given_to_sgds_replay_are_torchs_bits_and_leave_no_grad(name):
    """A shard hands a push's gradients to SGD's replay as they are (ShardServer.apply):
    torch.optim.SGD's bits and state over .grad, and no chunk's .grad is set."""
    make = OPTIMIZERS[name]
    ours, theirs = chunks(0), chunks(0)
    shard, reference = ShardOptimizer(make, ours), make(list(theirs.values()))
    assert shard.replays
    torch.manual_seed(3)
    for keys in ([0, 1, 2, 3], [3, 1], [0], [2, 3, 0]):
        grads = [torch.randn_like(theirs[k]) for k in keys]
        for k, g in zip(keys, grads):
            theirs[k].grad = g.clone()
        shard.step(keys, grads=grads)
        reference.step()
        for t in theirs.values():
            t.grad = None
        assert all(t.grad is None for t in ours.values())
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), (name, k)
    for i, s in reference.state_dict()["state"].items():
        assert torch.equal(shard.optimizer.state_dict()["state"][i]["momentum_buffer"], s["momentum_buffer"])


def test_only_sgds_replay_takes_gradients_as_given():
    values = chunks(0)
    shard = ShardOptimizer(OPTIMIZERS["adam"], values)
    assert not shard.replays
    with pytest.raises(ValueError, match="replays SGD"):
        shard.step([0], grads=[torch.ones_like(values[0])])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kernel", ["compiled", "torch"])
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n.startswith("sgd")])
def test_a_sync_steps_sum_divided_in_the_update_is_torchs_mean_bit_for_bit(name, kernel, dtype):
    """A sync step hands its sum of pushes and their count (ShardServer.apply's divisors): the
    same bits and state as torch.optim.SGD on the mean (torch's div_), whether the compiled
    kernel divides in its one pass (and it does, every step after a key's first) or torch's
    ops run; keys of 5 to 8 elements and of 3000 (whole vectors and a tail)."""
    if kernel == "compiled" and not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    ours = {k: torch.randn(n, dtype=dtype) for k, n in enumerate((5, 6, 8, 3000))}
    theirs = {k: t.clone() for k, t in ours.items()}
    shard, reference = ShardOptimizer(make, ours), make(list(theirs.values()))
    took = []
    if kernel == "torch":
        shard._fused = None
    else:
        kernel_fn = shard._fused
        shard._fused = lambda *args: took.append(kernel_fn(*args)) or took[-1]
    torch.manual_seed(4)
    steps = (([0, 1, 2, 3], 2), ([3, 1], 3), ([0, 2], 7), ([0, 1, 2, 3], 12), ([0, 1, 2, 3], 1))
    for keys, count in steps:
        sums = [torch.randn_like(theirs[k]) * count for k in keys]
        for k, s in zip(keys, sums):
            theirs[k].grad = s.clone().div_(count)
        shard.step(keys, grads=sums, divisors=[count] * len(keys))
        reference.step()
        for t in theirs.values():
            t.grad = None
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), (name, k)
    for i, s in reference.state_dict()["state"].items():
        assert torch.equal(shard.optimizer.state_dict()["state"][i]["momentum_buffer"], s["momentum_buffer"])
    if kernel == "compiled":  # a key's first momentum step makes its buffer with torch's ops
        first = 4 if "momentum" in name or "nesterov" in name or "dampening" in name else 0
        assert took.count(True) == sum(len(keys) for keys, _ in steps) - first and took.count(False) == first


@pytest.mark.skipif(not compiled.available(), reason="ps.shard._compiled is not built")
def test_the_compiled_kernel_takes_only_dense_alike_tensors_and_leaves_the_rest_unwritten():
    h = (0.1, 0.0, False, 0.9, 0.0, False)
    p, g, buf = torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    shared = torch.arange(9, dtype=torch.float64)
    refused = {
        "a strided gradient": (p, torch.ones(16, dtype=torch.float64)[::2], buf),
        "another dtype": (p, torch.ones(8), buf),
        "another size": (p, torch.ones(9, dtype=torch.float64), buf),
        "no momentum buffer yet": (p, g, None),
        "a buffer of another size": (p, g, torch.ones(4, dtype=torch.float64)),
        "a gradient that needs grad": (p, torch.ones(8, dtype=torch.float64, requires_grad=True), buf),
        "a negated view": (p, torch.ones(8, dtype=torch.float64)._neg_view(), buf),
        "a sparse gradient": (p, torch.ones(8, dtype=torch.float64).to_sparse(), buf),
        "an integer key": (torch.ones(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64), None),
        "a gradient over the values": (shared[:8], shared[1:], buf),
    }
    for why, (values, grad, momentum) in refused.items():
        before = (values.clone(), None if momentum is None else momentum.clone())
        assert not compiled.fused_sgd(values, grad, momentum, h if why != "an integer key" else (0.1, 0, False, 0, 0, False)), why
        assert torch.equal(values, before[0]) and (momentum is None or torch.equal(momentum, before[1])), why
    assert compiled.fused_sgd(p, g, buf, h, 2)
    assert torch.equal(buf, torch.full((8,), 0.9 + 0.5, dtype=torch.float64))
    assert torch.equal(p, torch.full((8,), 1 - 0.1 * (0.9 + 0.5), dtype=torch.float64))


@pytest.mark.skipif(not compiled.available(), reason="ps.shard._compiled is not built")
def test_a_kernel_that_rounds_otherwise_on_one_tail_is_not_used(monkeypatch):
    """The probe (compiled.arithmetic_matches) compares every tail length: a kernel off by one
    bit in the last element of 17, divided steps only, is caught, and a shard's optimizer
    then keeps to torch's ops."""
    real = compiled._compiled

    class OffByABit:
        Path = real.Path

        @staticmethod
        def sgd(values, grads, buf, f64, *args):
            real.sgd(values, grads, buf, f64, *args)
            if values.size == 17 and args[-1] != 1:
                values.view(numpy.uint8)[-1] ^= 1  # the last element's highest byte: one bit

    monkeypatch.setattr(compiled, "_MATCHES", None)
    assert compiled.arithmetic_matches()
    monkeypatch.setattr(compiled, "_compiled", OffByABit)
    monkeypatch.setattr(compiled, "_MATCHES", None)
    assert not compiled.arithmetic_matches()
    assert ShardOptimizer(OPTIMIZERS["sgd-momentum"], chunks(0))._fused is None
