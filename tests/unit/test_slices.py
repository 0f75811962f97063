"""A shard's large keys updated in slices on threads of its own (ps.shard.slices): where the
slices fall, that each runs once and errors come back, and SGD's bits, float64, against
torch.optim.SGD on the whole keys."""

from __future__ import annotations

import threading

import pytest
import torch

import ps.shard.compiled as compiled
from ps.shard.compiled import _compiled
from ps.shard.optim import ShardOptimizer
from ps.shard.slices import ALIGN, MIN_SLICE_BYTES, SlicePool


@pytest.fixture
def slice_pool():
    made = []

    def make(threads: int) -> SlicePool:
        made.append(SlicePool(threads))
        return made[-1]

    yield make
    for p in made:
        p.close()


def test_a_small_key_or_one_thread_is_not_split(slice_pool):
    big = 8 * MIN_SLICE_BYTES // 4
    assert slice_pool(4).cuts(2 * MIN_SLICE_BYTES // 4 - 1, 4) == [0, 2 * MIN_SLICE_BYTES // 4 - 1]
    assert slice_pool(1).cuts(big, 4) == [0, big]


@pytest.mark.parametrize("numel,threads,pieces", [(2 * MIN_SLICE_BYTES // 8 + 13, 4, 2),
                                                  (8 * MIN_SLICE_BYTES // 8 + 77, 3, 3),
                                                  (8 * MIN_SLICE_BYTES // 8 + 77, 16, 8)])
def test_slices_cover_the_key_from_aligned_starts(slice_pool, numel, threads, pieces):
    cuts = slice_pool(threads).cuts(numel, 8)
    assert cuts[0] == 0 and cuts[-1] == numel and len(cuts) == pieces + 1
    assert all(a % ALIGN == 0 and a < b for a, b in zip(cuts, cuts[1:]))


def test_each_slice_runs_once_the_last_on_the_callers_thread(slice_pool):
    p, seen, lock = slice_pool(3), [], threading.Lock()

    def fn(a, b):
        with lock:
            seen.append((a, b, threading.get_ident()))

    for _ in range(3):  # the threads are kept from one key to the next
        seen.clear()
        p.run(fn, [0, 64, 128, 200])
        assert sorted(s[:2] for s in seen) == [(0, 64), (64, 128), (128, 200)]
        mine = [s for s in seen if s[2] == threading.get_ident()]
        assert [m[:2] for m in mine] == [(128, 200)]
        assert len({s[2] for s in seen}) == 3
    with pytest.raises(ValueError, match="4 slices for a pool of 3"):
        p.run(fn, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("failing", [0, 2])
def test_an_error_in_any_slice_is_raised_after_all_have_run(slice_pool, failing):
    p, done = slice_pool(3), []

    def fn(a, b):
        if a == failing:
            raise RuntimeError(f"slice at {a}")
        done.append(a)

    with pytest.raises(RuntimeError, match=f"slice at {failing}"):
        p.run(fn, [0, 1, 2, 3])
    assert sorted(done) == sorted({0, 1, 2} - {failing})
    p.run(lambda a, b: done.append(-a), [0, 1, 2, 3])  # still serves
    assert sorted(done)[:3] == [-2, -1, 0]


SGDS = {
    "sgd": dict(lr=0.1),
    "momentum-decay": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    "nesterov-maximize": dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    "dampening": dict(lr=0.1, momentum=0.5, dampening=0.3, weight_decay=0.1),
}


SIZES = {0: 2 * MIN_SLICE_BYTES // 8 + 5, 1: 3 * MIN_SLICE_BYTES // 8 + 131, 2: 1000}
"""float64 keys of 2 and 3 slices on 8 threads offered, and one too small to split."""
STEPS = ([0, 1, 2], [1], [0, 2], [0, 1, 2])


def step_both(make, kernel: bool = False):
    """A shard's optimizer (make) on 8 slice threads and torch's own on the whole keys, over
    STEPS with the same gradients: asserts the same values and state, and returns how many
    slices each call through the pool had. kernel: SGD's compiled kernel takes what it can
    (large keys split over its own threads), else it is off (Python's slices)."""
    torch.manual_seed(0)
    ours = {k: torch.randn(n, dtype=torch.float64) for k, n in SIZES.items()}
    theirs = {k: t.clone() for k, t in ours.items()}
    shard, reference = ShardOptimizer(make, ours), make(list(theirs.values()))
    if not kernel:
        shard._fused = None
    assert shard.take_threads(8)
    calls = []
    run = shard._slices.run
    shard._slices.run = lambda fn, cuts: (calls.append(len(cuts) - 1), run(fn, cuts))
    for keys in STEPS:
        for k in keys:
            grad = torch.randn(SIZES[k], dtype=torch.float64)
            ours[k].grad, theirs[k].grad = grad.clone(), grad.clone()
        shard.step(keys)
        reference.step()  # torch steps the keys with a gradient
        for t in (*ours.values(), *theirs.values()):
            t.grad = None
    shard._slices.close()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    mine, ref = shard.optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert set(mine) == set(ref)
    for i, s in ref.items():
        assert set(mine[i]) == set(s)
        for slot, value in s.items():
            assert (mine[i][slot] is None) if value is None else torch.equal(mine[i][slot], value), (i, slot)
    return calls


@pytest.mark.parametrize("name", SGDS)
def test_sgd_in_slices_is_torchs_sgd_bit_for_bit(name):
    """Steps that make the momentum buffers and then use them, without the compiled kernel:
    every step of the large keys went through the pool."""
    calls = step_both(lambda ps: torch.optim.SGD(ps, **SGDS[name]))
    assert sorted(set(calls)) == [2, 3] and len(calls) == 6  # keys 0 and 1, each time they stepped


@pytest.mark.skipif(not compiled.available() or not compiled.arithmetic_matches(), reason="no compiled kernel")
@pytest.mark.parametrize("name", SGDS)
def test_sgd_split_by_the_compiled_kernel_is_torchs_bit_for_bit(name, kernel_threads):
    """With the compiled kernel, the large keys' steps are split over its own 8 threads
    (ps/shard/_split.h); only a key's first step with momentum, which makes the buffer (the
    kernel takes none), goes through Python's slices."""
    split_before, _ = _compiled.split_counts()
    calls = step_both(lambda ps: torch.optim.SGD(ps, **SGDS[name]), kernel=True)
    assert _compiled.threads() == 8
    firsts = 2 if SGDS[name].get("momentum") else 0  # keys 0 and 1 step 6 times in all
    assert len(calls) == firsts and _compiled.split_counts()[0] - split_before == 6 - firsts


def test_a_shard_keeps_torch_on_one_thread_only_where_it_slices(kernel_threads):
    from ps.config import PSConfig
    from ps.layout import ParamSpec, build_layout, split_values
    from ps.shard.server import ShardServer

    layout = build_layout([ParamSpec("w", (8,), "float32")], 1, 2**20)

    def server(make):
        return ShardServer(0, layout, split_values(layout, [torch.zeros(8)], 0), make, "async", 1, PSConfig())

    before = torch.get_num_threads()
    try:
        sgd, adam = server(lambda ps: torch.optim.SGD(ps, lr=0.1)), server(lambda ps: torch.optim.Adam(ps, lr=0.1))
        rms = server(lambda ps: torch.optim.RMSprop(ps, lr=0.1))  # not one the shards slice
        assert sgd.use_cores(4) == 1 and sgd.optimizer._slices.threads == 4
        if sgd.optimizer._fused is not None:  # and the compiled kernel's, for SGD's large keys
            assert _compiled.threads() == 4
        assert adam.use_cores(3) == 1 and adam.optimizer._slices.threads == 3
        assert rms.use_cores(3) == 3 and rms.optimizer._slices is None
        assert sgd.use_cores(1) == 1 and sgd.optimizer._slices is None
        assert sgd.optimizer._fused is None or _compiled.threads() == 1
    finally:
        torch.set_num_threads(before)


OTHERS = {
    "adam": (torch.optim.Adam, dict(lr=0.01), 4),
    "adam-amsgrad-decay-maximize": (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1, maximize=True), 4),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05), 4),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.5,
                                          weight_decay=0.01), 6),
}


@pytest.mark.parametrize("name", OTHERS)
def test_elementwise_optimizers_in_slices_are_torchs_bit_for_bit(name):
    """Adam, AdamW and Adagrad step each slice with torch's own step and the slices of the
    key's state, the step count advanced once. Adam's first step of a key makes its state
    whole; later steps (Adagrad's from the first: its state is made with it) go through the
    pool."""
    cls, kwargs, sliced = OTHERS[name]
    calls = step_both(lambda ps: cls(ps, **kwargs))
    assert len(calls) == sliced and set(calls) == {2, 3}


def test_a_first_momentum_buffer_is_kept_only_once_every_slice_filled_it(kernel_threads):
    """A slice that fails leaves no half-filled buffer for the next step to take as momentum."""
    values = {0: torch.zeros(SIZES[0], dtype=torch.float64)}
    shard = ShardOptimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), values)
    assert shard.take_threads(2)

    def fail_after_first(fn, cuts):
        fn(cuts[0], cuts[1])
        raise RuntimeError("a slice failed")

    shard._slices.run = fail_after_first
    values[0].grad = torch.ones_like(values[0])
    with pytest.raises(RuntimeError, match="a slice failed"):
        shard.step([0])
    assert shard.optimizer.state[values[0]].get("momentum_buffer") is None


@pytest.mark.skipif(compiled._compiled is None, reason="the compiled module is not built")
def test_slices_run_under_the_callers_floating_point_controls(slice_pool):
    """After torch.set_flush_denormal(True) on the caller's thread, a slice on a pool thread
    started before it flushes denormals as the caller's does (halving 3e-39 gives 0)."""
    x = torch.full((4096,), 3e-39)
    out = torch.empty_like(x)
    pool = slice_pool(3)
    pool.run(lambda a, b: out[a:b].copy_(x[a:b] * 0.5), [0, 1024, 2048, 4096])  # the threads started
    assert out.ne(0).all()
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero on this CPU")
    try:
        pool.run(lambda a, b: out[a:b].copy_(x[a:b] * 0.5), [0, 1024, 2048, 4096])
    finally:
        torch.set_flush_denormal(False)
    assert out.eq(0).all()
    with pytest.raises(ValueError, match="floating-point controls"):
        _compiled.set_fp_controls(1 << 20)
