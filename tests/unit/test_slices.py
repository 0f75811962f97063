"""A shard's large keys updated in slices on threads of its own (ps.shard.slices): where the
slices fall, that each runs once and errors come back, and SGD's bits, float64, against
torch.optim.SGD on the whole keys."""

from __future__ import annotations

import threading

import pytest
import torch

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


@pytest.mark.parametrize("name", SGDS)
def test_sgd_in_slices_is_torchs_sgd_bit_for_bit(name):
    """Keys of 2 and 3 slices (8 threads offered) and a small one, float64, over steps that
    make the momentum buffers and then use them: the same values and state as torch's SGD on
    the whole keys, and the large keys did go through the pool."""
    torch.manual_seed(0)
    sizes = {0: 2 * MIN_SLICE_BYTES // 8 + 5, 1: 3 * MIN_SLICE_BYTES // 8 + 131, 2: 1000}
    ours = {k: torch.randn(n, dtype=torch.float64) for k, n in sizes.items()}
    theirs = {k: t.clone() for k, t in ours.items()}
    shard = ShardOptimizer(lambda ps: torch.optim.SGD(ps, **SGDS[name]), ours)
    assert shard.take_threads(8)
    reference = torch.optim.SGD(list(theirs.values()), **SGDS[name])
    calls = []
    run = shard._slices.run
    shard._slices.run = lambda fn, cuts: (calls.append(len(cuts) - 1), run(fn, cuts))
    for keys in ([0, 1, 2], [1], [0, 2], [0, 1, 2]):
        for k in keys:
            grad = torch.randn(sizes[k], dtype=torch.float64)
            ours[k].grad, theirs[k].grad = grad.clone(), grad.clone()
        shard.step(keys)
        reference.step()
        for t in (*ours.values(), *theirs.values()):
            t.grad = None
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), (name, k)
    mine, ref = shard.optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert set(mine) == set(ref)
    for i, s in ref.items():
        assert torch.equal(mine[i]["momentum_buffer"], s["momentum_buffer"]), (name, i)
    assert sorted(set(calls)) == [2, 3] and len(calls) == 6  # keys 0 and 1, each time they stepped
    shard._slices.close()


def test_a_shard_keeps_torch_on_one_thread_only_where_it_slices():
    from ps.config import PSConfig
    from ps.layout import ParamSpec, build_layout, split_values
    from ps.shard.server import ShardServer

    layout = build_layout([ParamSpec("w", (8,), "float32")], 1, 2**20)

    def server(make):
        return ShardServer(0, layout, split_values(layout, [torch.zeros(8)], 0), make, "async", 1, PSConfig())

    before = torch.get_num_threads()
    try:
        sgd, adam = server(lambda ps: torch.optim.SGD(ps, lr=0.1)), server(lambda ps: torch.optim.Adam(ps, lr=0.1))
        assert sgd.use_cores(4) == 1 and sgd.optimizer._slices.threads == 4
        assert adam.use_cores(3) == 3 and adam.optimizer._slices is None
        assert sgd.use_cores(1) == 1 and sgd.optimizer._slices is None
    finally:
        torch.set_num_threads(before)
