"""ps-sync with backup workers (ps.backup_workers=b), on one shard without sockets: each key
of a step is updated with the mean of the first N - b live workers' pushes; later pushes of
the step are dropped, counted, and answered with the new values. Float64, exact."""

import pytest
import torch

from tests.unit.test_ps_server import FakeClock, KEYS, LAYOUT, call, grads_of, make, push, values

G = [torch.arange(15.0, dtype=torch.float64) * (w + 1) - w for w in range(4)]


def test_without_backups_a_step_waits_for_every_worker():
    server, init = make("sync", workers=3)
    push(server, 0, 0, grads_of(G[0]))
    push(server, 1, 0, grads_of(G[1]))
    assert server.version == 0 and torch.equal(values(server), init)
    push(server, 2, 0, grads_of(G[2]))
    assert server.version == 1
    assert torch.equal(values(server), init - 0.5 * (G[0] + G[1] + G[2]) / 3)
    assert server.stats()["dropped"] == {} and server.counters["dropped_keys"] == 0


def test_one_backup_updates_with_the_first_two_of_three_and_drops_the_late_push():
    server, init = make("sync", workers=3, backup_workers=1)
    push(server, 2, 0, grads_of(G[2]))
    assert server.version == 0
    push(server, 0, 0, grads_of(G[0]), pull=1, min_version=1)
    assert server.version == 1
    after = init - 0.5 * (G[2] + G[0]) / 2
    assert torch.equal(values(server), after)
    # Worker 1's push of step 0 comes after the step: dropped, answered with the new values.
    (reply,) = push(server, 1, 0, grads_of(G[1]), pull=1, min_version=1)
    assert reply.op == "ok" and reply.get("version") == 1
    assert torch.equal(torch.cat(reply.tensors), after)
    assert torch.equal(values(server), after)
    stats = server.stats()
    assert stats["dropped"] == {"0": [1]} and stats["dropped_keys"] == len(KEYS)
    # Step 1 goes on as usual; the worker whose push was dropped takes part.
    push(server, 1, 1, grads_of(G[1]), version=1)
    push(server, 2, 1, grads_of(G[2]), version=1)
    assert server.version == 2
    assert torch.equal(values(server), after - 0.5 * (G[1] + G[2]) / 2)


def test_a_key_already_updated_drops_only_that_key_of_a_late_push():
    """Per key: worker 2's push of step 0 comes after key 0 was updated with workers 0 and 1,
    but before key 1 was: key 0 of it is dropped, key 1 of it counts."""
    server, init = make("sync", workers=3, backup_workers=1)
    first, second, rest = KEYS[:1], KEYS[1:2], KEYS[2:]
    push(server, 0, 0, grads_of(G[0]), keys=first)
    push(server, 1, 0, grads_of(G[1]), keys=first)
    push(server, 2, 0, grads_of(G[2]), keys=first + second)
    push(server, 0, 0, grads_of(G[0]), keys=second + rest)
    push(server, 1, 0, grads_of(G[1]), keys=second + rest)
    assert server.version == 1
    k0, k1 = (LAYOUT.keys[k] for k in KEYS[:2])
    expected = init.clone()
    span0, span1 = slice(0, k0.numel), slice(k0.numel, k0.numel + k1.numel)
    expected[span0] -= 0.5 * (G[0] + G[1])[span0] / 2
    expected[span1] -= 0.5 * (G[2] + G[0])[span1] / 2  # the first two pushes of key 1
    tail = slice(k0.numel + k1.numel, None)
    expected[tail] -= 0.5 * (G[0] + G[1])[tail] / 2
    assert torch.equal(values(server), expected)
    assert server.stats()["dropped"] == {"0": [1, 2]}  # worker 2's key 0, worker 1's key 1
    assert server.counters["dropped_keys"] == 2


def test_a_lost_worker_leaves_the_others_with_their_backups():
    clock = FakeClock()
    server, init = make("sync", workers=3, backup_workers=1, clock=clock, on_worker_loss="drop",
                        worker_timeout_s=3.0, heartbeat_s=0.5)
    clock.now += 2.0
    for w in (0, 1):
        call(server, w, "heartbeat")
    clock.now += 2.0
    server.tick()  # worker 2 lost: two live, one of them a backup
    assert server.stats()["live_workers"] == [0, 1]
    push(server, 1, 0, grads_of(G[1]))
    assert server.version == 1 and torch.equal(values(server), init - 0.5 * G[1])


def test_a_step_held_for_a_clip_is_refused_with_backups():
    server, _ = make("sync", workers=3, backup_workers=1)
    (err,) = push(server, 0, 0, grads_of(G[0]), hold=1)
    assert err.op == "error" and "ps.backup_workers=1" in err.get("error")
    assert server.version == 0 and server.counters["pushes"] == 0


def test_without_backups_a_late_push_is_still_refused():
    server, _ = make("sync", workers=2)
    push(server, 0, 0, grads_of(G[0]))
    push(server, 1, 0, grads_of(G[1]))
    (err,) = push(server, 1, 0, grads_of(G[1]), keys=KEYS)
    assert err.op == "error" and "already pushed all keys of step 0" in err.get("error")


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_backup_workers_must_be_a_count(bad):
    with pytest.raises(ValueError, match="ps.backup_workers"):
        make("sync", workers=3, backup_workers=bad)


def test_with_backups_a_push_after_a_worker_left_is_dropped():
    """The others finished and left: a worker whose loop runs on must not train alone."""
    server, init = make("sync", workers=3, backup_workers=1)
    push(server, 0, 0, grads_of(G[0]))
    push(server, 1, 0, grads_of(G[1]))
    after = init - 0.5 * (G[0] + G[1]) / 2
    for w in (0, 1):
        assert call(server, w, "leave")[0].op == "ok"
    (reply,) = push(server, 2, 1, grads_of(G[2]), version=1, pull=1, min_version=2)
    assert reply.op == "ok" and server.version == 1 and torch.equal(values(server), after)
    assert server.stats()["dropped"] == {"1": [2]}


def test_with_backups_the_first_step_waits_until_every_worker_has_joined():
    server, init = make("sync", workers=3, backup_workers=1, joined=(0, 1))
    push(server, 0, 0, grads_of(G[0]))
    push(server, 1, 0, grads_of(G[1]))
    assert server.version == 0  # worker 2 has not joined: the run has not started without it
    call(server, 2, "join")
    assert server.version == 1 and torch.equal(values(server), init - 0.5 * (G[0] + G[1]) / 2)
