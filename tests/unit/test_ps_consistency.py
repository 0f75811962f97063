"""The consistency rules (ps.shard.consistency) alone, on a fake shard: when a push updates,
when a pull is answered, what a version counts, and the ssp staleness bound."""

import subprocess
import sys

import pytest
import torch

from ps.config import PSConfig
from ps.protocol import MODES, Message
from ps.shard.consistency import RULES, AsyncRule, Rule, SSPRule, SyncRule, make_rule
from ps.shard.reject import Reject
from ps.shard.workers import Workers


class FakeHost:
    """The Host a rule works on: two dense keys of 3 values (key 2, if rows: 4 rows of 2),
    optimizer steps recorded instead of run."""

    def __init__(self, workers=2, rows=False, **cfg):
        self.version = 0
        self.chunks = {0: torch.zeros(3, dtype=torch.float64), 1: torch.zeros(3, dtype=torch.float64)}
        if rows:
            self.chunks[2] = torch.zeros(4, 2, dtype=torch.float64)
        self.keys = list(self.chunks)
        self.workers = Workers(workers, len(self.keys))
        self.config = PSConfig(**cfg)
        self.counters = dict(updates=0, row_collisions=0)
        self.applied = []  # (keys, {key: grad}, lr)

    def apply(self, keys, label, count=True, lr=None, grads=None, divisors=None):
        assert grads is not None and len(grads) == len(keys), "a rule gives the gradients of the keys it applies"
        if divisors is not None:  # as ShardServer.apply: each gradient divided by its own
            grads = [g / d for g, d in zip(grads, divisors)]
        self.applied.append((list(keys), dict(zip(keys, grads)), lr))
        self.counters["updates"] += int(count)

    def bump(self):
        self.version += 1


def g(*values):
    return torch.tensor(values, dtype=torch.float64)


def push(rule, w, step, grads, lr=None, hold=False, ids=None):
    """Check and take a push of {key: grad} by w, as the shard does."""
    keys = list(grads)
    msg = Message({"op": "push", "worker": w, "req": 1, "step": step, "keys": keys,
                   **({"hold": 1} if hold else {}), **({"lr": lr} if lr is not None else {})},
                  list(grads.values()), ids or [])
    rule.check_step(w, step)
    rule.check_push(w, step, msg)
    rule.push(w, step, keys, list(grads.values()), ids or [None] * len(keys), lr, hold)


def pull(clock=None, **fields):
    return Message({"op": "pull", "worker": 0, "req": 2, "keys": [0, 1],
                    **({"clock": clock} if clock is not None else {}), **fields})


def test_one_rule_per_mode_behind_one_interface():
    assert tuple(RULES) == MODES == ("sync", "async", "ssp")
    for mode in MODES:
        rule = make_rule(mode, FakeHost())
        assert isinstance(rule, Rule) and rule.name == mode
    with pytest.raises(ValueError, match="mode must be one of"):
        make_rule("bsp", FakeHost())


# -- sync --------------------------------------------------------------------------------------


def test_sync_updates_a_key_once_every_live_worker_pushed_it_with_the_mean():
    host = FakeHost()
    rule = SyncRule(host)
    push(rule, 0, 0, {0: g(1, 2, 3)}, lr=0.1)
    assert host.applied == []  # worker 1 has not pushed key 0
    push(rule, 1, 0, {0: g(3, 2, 1)}, lr=0.1)
    (keys, grads, lr), = host.applied
    assert keys == [0] and torch.equal(grads[0], g(2, 2, 2)) and lr == 0.1
    # key 0 is one version ahead of the shard; the step is not done until key 1 is
    assert host.version == 0 and rule.version_of([0]) == 1 and rule.version_of([0, 1]) == 0
    push(rule, 0, 0, {1: g(1, 1, 1)})
    push(rule, 1, 0, {1: g(3, 3, 3)})
    assert host.version == 1 and host.counters["updates"] == 1 and rule.version_of([0, 1]) == 1
    assert torch.equal(host.applied[1][1][1], g(2, 2, 2))
    assert host.workers.clocks == {0: 1, 1: 1}


def test_sync_refuses_a_push_of_another_step_and_disagreeing_pushes():
    host = FakeHost()
    rule = SyncRule(host)
    with pytest.raises(Reject, match="sync push for step 1, but the shard is at step 0"):
        rule.check_step(0, 1)
    push(rule, 0, 0, {0: g(1, 1, 1)}, lr=0.1)
    with pytest.raises(Reject, match="lr=0.2, another worker with lr=0.1"):
        push(rule, 1, 0, {0: g(1, 1, 1)}, lr=0.2)
    with pytest.raises(Reject, match="every worker must clip, or none"):
        push(rule, 1, 0, {0: g(1, 1, 1)}, lr=0.1, hold=True)
    assert host.applied == []


def test_sync_step_goes_on_without_a_worker_that_is_gone():
    host = FakeHost()
    rule = SyncRule(host)
    push(rule, 0, 0, {0: g(4, 4, 4), 1: g(2, 2, 2)})
    assert host.applied == []
    host.workers.lose(1, "test")
    rule.worker_gone()
    assert host.version == 1 and [k for keys, _, _ in host.applied for k in keys] == [0, 1]
    assert torch.equal(host.applied[0][1][0], g(4, 4, 4))  # the mean over the workers that pushed


def test_sync_held_step_waits_for_the_clip_scale():
    host = FakeHost()
    rule = SyncRule(host)
    rule.check_norm()  # sync steps may hold
    for w in (0, 1):
        assert not rule.norm_ready(0)
        push(rule, w, 0, {0: g(1, 2, 2), 1: g(0, 0, 1)}, hold=True)
    assert host.applied == [] and host.version == 0
    assert rule.norm_ready(0) and rule.norm_of(0) == pytest.approx(10.0)
    with pytest.raises(Reject, match=r"clip scale for step 1, but this shard \(at step 0\)"):
        rule.scale(pull(min_version=2, scale=0.5))
    rule.scale(pull(min_version=1, scale=0.5))
    assert host.version == 1 and torch.equal(host.applied[0][1][0], g(0.5, 1, 1))
    rule.scale(pull(min_version=1, scale=0.5))  # the same scale again: nothing more
    assert len(host.applied) == 1
    with pytest.raises(Reject, match="updated with 0.5"):
        rule.scale(pull(min_version=1, scale=0.25))


# -- async -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale,factor", [("mean", 0.5), ("sum", 1.0)])
def test_async_applies_every_push_at_once(scale, factor):
    host = FakeHost(async_scale=scale)
    rule = AsyncRule(host)
    push(rule, 1, 0, {0: g(2, 4, 6)}, lr=0.3)
    (keys, grads, lr), = host.applied
    assert keys == [0] and torch.equal(grads[0], g(2, 4, 6) * factor) and lr == 0.3
    assert host.version == 0  # worker 1's step 0 is not complete on this shard yet
    push(rule, 1, 0, {1: g(1, 1, 1)})
    assert host.version == 1 and host.workers.clocks[1] == 1 and len(host.applied) == 2
    assert rule.versions_per_step == 2 and rule.version_of([0, 1]) == host.version


def test_async_refuses_what_only_sync_steps_have():
    rule = AsyncRule(FakeHost())
    with pytest.raises(Reject, match="only under sync"):
        push(rule, 0, 0, {0: g(1, 1, 1)}, hold=True)
    with pytest.raises(Reject, match="'norm' is for sync steps"):
        rule.check_norm()
    with pytest.raises(Reject, match="clip 'scale' is for sync steps"):
        rule.scale(pull(scale=1.0))
    assert rule.pull_ready(pull(clock=1000))  # no staleness bound


def test_async_counts_rows_another_worker_changed_since_a_worker_read():
    host = FakeHost(rows=True)
    rule = AsyncRule(host)
    rule.read(0), rule.read(1)
    ids = torch.tensor([1, 2])
    push(rule, 1, 0, {2: torch.ones(2, 2, dtype=torch.float64)}, ids=[ids])
    assert host.counters["row_collisions"] == 0
    assert host.applied[0][1][2].is_sparse  # the optimizer sees only the pushed rows
    push(rule, 0, 0, {2: torch.ones(2, 2, dtype=torch.float64)}, ids=[torch.tensor([2, 3])])
    assert host.counters["row_collisions"] == 1  # row 2, changed by worker 1 after worker 0 read
    rule.read(0)
    push(rule, 0, 1, {2: torch.ones(1, 2, dtype=torch.float64)}, ids=[torch.tensor([1])])
    assert host.counters["row_collisions"] == 1  # read since: no collision


# -- ssp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_ssp_answers_a_pull_only_within_the_staleness_bound(staleness):
    host = FakeHost(staleness=staleness)
    rule = SSPRule(host)
    host.workers.clocks.update({0: 5, 1: 2})
    for clock in range(0, 9):
        assert rule.pull_ready(pull(clock=clock)) == (clock - 2 <= staleness), clock
    assert rule.pull_ready(pull())  # no clock: no condition
    blocked = pull(clock=staleness + 3)
    assert not rule.pull_ready(blocked)
    assert rule.pull_waits_for(blocked) == (f"clock {staleness + 3} to be within staleness {staleness} "
                                            "of the slowest live worker (worker 1 at clock 2)")
    host.workers.clocks[1] = 3  # the slowest catches up
    assert rule.pull_ready(blocked)


def test_ssp_bound_counts_only_live_workers():
    host = FakeHost(workers=3, staleness=1)
    rule = SSPRule(host)
    host.workers.clocks.update({0: 4, 1: 0, 2: 3})
    assert not rule.pull_ready(pull(clock=5))
    host.workers.lose(1, "test")
    assert rule.pull_ready(pull(clock=4)) and not rule.pull_ready(pull(clock=5))
    host.workers.leave(2)
    assert rule.pull_ready(pull(clock=5))
    host.workers.leave(0)
    assert rule.pull_ready(pull(clock=100))  # nobody left to wait for


def test_ssp_applies_pushes_as_async_does():
    host = FakeHost(async_scale="sum")
    rule = SSPRule(host)
    push(rule, 0, 0, {0: g(1, 1, 1), 1: g(2, 2, 2)})
    assert host.version == 1 and len(host.applied) == 1 and host.workers.clocks[0] == 1


def test_importing_the_shard_leaves_torch_sparse_checks_alone():
    code = ("import torch; torch.sparse.check_sparse_tensor_invariants.enable(); "
            "import ps.shard, ps.engine, ps.local; "
            "assert torch.sparse.check_sparse_tensor_invariants.is_enabled()")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
