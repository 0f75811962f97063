"""ShardServer.handle / tick without sockets: sync barrier, async scaling, ssp bound,
deferred pulls, rejections and liveness, driven by a fake clock."""

import pytest
import torch

from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, split_values
from ps.protocol import decode, encode
from ps.shard import ShardServer

SPECS = [ParamSpec("w", (4, 3), "float64"), ParamSpec("b", (3,), "float64")]
LAYOUT = build_layout(SPECS, 1, 5)
KEYS = [k.id for k in LAYOUT.keys]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(mode, workers=2, lr=0.5, clock=None, optimizer=None, joined=None, **cfg):
    torch.manual_seed(0)
    init = [torch.randn(s.shape, dtype=torch.float64) for s in SPECS]
    opt = optimizer or (lambda p: torch.optim.SGD(p, lr=lr))
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, init, 0), opt, mode, workers,
                         PSConfig(**cfg), clock=clock or FakeClock())
    flat = torch.cat([p.reshape(-1) for p in init])
    for w in range(workers) if joined is None else joined:
        assert call(server, w, "join")[0].op == "ok"
    return server, flat


def call(server, worker, op, tensors=None, **fields):
    """Send one request from peer b'w<worker>'; decoded replies as a list."""
    replies = server.handle(f"w{worker}".encode(), encode({"op": op, "worker": worker, "req": 1, **fields}, tensors))
    return [decode(frames) for _, frames in replies]


def push(server, worker, step, grads, version=None, keys=KEYS, **fields):
    version = step if version is None else version
    return call(server, worker, "push", [grads[k] for k in keys], step=step, version=version, keys=list(keys),
                **fields)


def grads_of(flat_grad):
    return {k.id: flat_grad[k.offset + (0 if k.param == 0 else 12):][:k.numel].clone() for k in LAYOUT.keys}


def values(server):
    return torch.cat([server.chunks[k] for k in KEYS])


def test_sync_barrier_mean_and_deferred_pull():
    server, init = make("sync")
    g0, g1 = torch.arange(15.0, dtype=torch.float64), torch.ones(15, dtype=torch.float64)
    assert push(server, 0, 0, grads_of(g0))[0].op == "ok"
    assert call(server, 0, "pull", keys=[], min_version=1) == []  # deferred: step 0 not complete
    assert server.version == 0 and torch.equal(values(server), init)
    replies = push(server, 1, 0, grads_of(g1))
    assert [r.op for r in replies] == ["ok", "ok"] and server.version == 1
    pulled = replies[1]
    assert pulled.worker == 0 and pulled.get("version") == 1
    expected = init - 0.5 * (g0 + g1) / 2
    assert torch.equal(values(server), expected)
    assert torch.equal(torch.cat(pulled.tensors), expected)
    assert server.stats()["queue_wait"]["count"] == 1 and server.stats()["updates"] == 1


def test_push_with_pull_is_answered_with_the_updated_values_in_one_reply():
    """push(pull=1): sync holds the one reply until the step is done, then sends the values
    (with the push's staleness); async sends the values right after applying the push."""
    server, init = make("sync")
    g0, g1 = torch.arange(15.0, dtype=torch.float64), torch.ones(15, dtype=torch.float64)
    assert push(server, 0, 0, grads_of(g0), pull=1, min_version=1) == []  # held: worker 1 has not pushed
    replies = call(server, 1, "push", [grads_of(g1)[k] for k in KEYS], step=0, version=0, keys=KEYS,
                   pull=1, min_version=1)
    expected = init - 0.5 * (g0 + g1) / 2
    assert [(r.op, r.worker) for r in replies] == [("ok", 1), ("ok", 0)]
    for r in replies:
        assert r.get("version") == 1 and r.get("staleness") == 0 and r.keys == KEYS
        assert torch.equal(torch.cat(r.tensors), expected)
    assert replies[1].get("waited_us") >= 0 and server.counters["pulls"] == 2

    server, init = make("async", lr=1.0, async_scale="sum")
    (reply,) = push(server, 0, 0, grads_of(g0), pull=1)
    assert reply.op == "ok" and torch.equal(torch.cat(reply.tensors), init - g0)
    assert reply.get("staleness") == 0 and reply.get("version") == 1


def test_a_reply_leaves_from_the_chunk_which_moves_before_an_update_while_a_reply_points_at_it():
    server, init = make("async", lr=1.0, async_scale="sum")
    g = torch.ones(15, dtype=torch.float64)
    (held,) = push(server, 0, 0, grads_of(g), pull=1)
    first = [t.data_ptr() for t in held.tensors]
    assert first == [server.chunks[k].data_ptr() for k in KEYS]  # no copy: the chunk's own memory
    (later,) = push(server, 0, 1, grads_of(g), pull=1)
    # The held reply still points at the former memory: the update was written elsewhere.
    assert not {t.data_ptr() for t in later.tensors} & set(first)
    assert torch.equal(torch.cat(held.tensors), init - g)
    assert torch.equal(torch.cat(later.tensors), init - 2 * g)
    del held, later
    (reply,) = push(server, 0, 2, grads_of(g), pull=1)
    assert torch.equal(torch.cat(reply.tensors), init - 3 * g)
    if hasattr(torch._C, "_storage_Use_Count"):  # no reply pointed at the chunk: updated in place
        where = [server.chunks[k].data_ptr() for k in KEYS]
        del reply
        push(server, 0, 3, grads_of(g))
        assert [server.chunks[k].data_ptr() for k in KEYS] == where
        assert torch.equal(values(server), init - g - g - g - g)


@pytest.mark.skipif(not hasattr(torch._C, "_storage_Use_Count"), reason="this torch keeps no storage use count")
def test_an_older_snapshot_is_reused_while_a_newer_one_is_still_being_sent():
    server, init = make("async", lr=1.0, async_scale="sum")
    g = torch.ones(15, dtype=torch.float64)
    (old,) = push(server, 0, 0, grads_of(g), pull=1)
    first = [t.data_ptr() for t in old.tensors]
    (newer,) = push(server, 0, 1, grads_of(g), pull=1)  # a new buffer: the first is held
    del old  # sent; the newer reply is not yet
    (reply,) = push(server, 0, 2, grads_of(g), pull=1)
    assert [t.data_ptr() for t in reply.tensors] == first
    assert torch.equal(torch.cat(newer.tensors), init - 2 * g)
    assert torch.equal(torch.cat(reply.tensors), init - 3 * g)


def test_push_with_pull_refuses_a_bad_flag_without_applying():
    server, init = make("async")
    err = push(server, 0, 0, grads_of(torch.ones(15, dtype=torch.float64)), pull=2)[0]
    assert err.op == "error" and "'pull' is 2; expected 0 or 1" in err.get("error")
    assert torch.equal(values(server), init) and server.counters["updates"] == 0


def test_sync_push_in_pieces_and_rejections():
    server, _ = make("sync")
    g = grads_of(torch.ones(15, dtype=torch.float64))
    assert push(server, 0, 0, g, keys=KEYS[:1])[0].op == "ok"
    err = push(server, 0, 0, g, keys=KEYS[:2])[0]
    assert err.op == "error" and f"pushed key(s) [{KEYS[0]}] of step 0 twice" in err.get("error")
    assert "shard is at step 0" in push(server, 1, 1, g, version=0)[0].get("error")
    assert "only at version 0" in push(server, 1, 0, g, version=3)[0].get("error")
    assert "push names no keys" in push(server, 1, 0, g, keys=[])[0].get("error")
    assert push(server, 0, 0, g, keys=KEYS[1:])[0].op == "ok"
    push(server, 1, 0, g)
    assert server.version == 1
    assert "already pushed all keys of step 0" in push(server, 0, 0, g)[0].get("error")
    assert server.stats()["rejected"] == 5


def test_requests_before_join_and_replies_are_refused():
    server, _ = make("sync", workers=3)
    server.workers.seen.pop(2)
    assert "worker 2 has not joined" in call(server, 2, "pull", keys=[])[0].get("error")
    assert "expected a request" in call(server, 0, "ok")[0].get("error")


@pytest.mark.parametrize("scale,factor", [("sum", 1.0), ("mean", 0.5)])
def test_async_applies_each_push_at_once(scale, factor):
    server, init = make("async", lr=1.0, async_scale=scale)
    g = torch.full((15,), 0.25, dtype=torch.float64)
    push(server, 0, 0, grads_of(g), keys=KEYS[:1])  # part of a step: applied, version unchanged
    assert server.version == 0 and server.stats()["updates"] == 1
    push(server, 0, 0, grads_of(g), keys=KEYS[1:])
    assert server.version == 1  # one completed worker-step
    reply = push(server, 1, 0, grads_of(g), version=0)[0]
    assert reply.get("staleness") == 1 and server.version == 2
    assert torch.equal(values(server), init - 2 * factor * g)
    assert server.stats()["staleness"] == {"0": 2, "1": 1}


@pytest.mark.parametrize("staleness", [0, 1])
def test_ssp_bound(staleness):
    server, _ = make("ssp", staleness=staleness)
    g = grads_of(torch.ones(15, dtype=torch.float64))
    blocked_at = None
    for clock in range(1, 4):  # worker 0 runs ahead; worker 1 is still at clock 0
        push(server, 0, clock - 1, g, version=server.version)
        if not call(server, 0, "pull", keys=[], clock=clock):
            blocked_at = clock
            break
    assert blocked_at == staleness + 1  # clock - slowest (0) may not exceed the bound
    released = push(server, 1, 0, g, version=0)
    assert [r.op for r in released] == ["ok", "ok"]
    clocks = server.stats()["clocks"]
    assert blocked_at - min(clocks.values()) <= staleness


def test_deferred_pull_times_out_with_reason():
    clock = FakeClock()
    server, _ = make("sync", clock=clock, timeout_s=5.0)
    assert call(server, 0, "pull", keys=[], min_version=1) == []
    clock.now += 4.0
    assert server.tick() == []
    clock.now += 1.5
    (_, frames), = server.tick()
    err = decode(frames).get("error")
    assert "waited 5.50 s" in err and "version >= 1 (shard at version 0)" in err


def test_drop_lets_the_step_complete_without_the_lost_worker():
    clock = FakeClock()
    server, init = make("sync", clock=clock, on_worker_loss="drop", worker_timeout_s=3.0, heartbeat_s=0.5)
    g0 = torch.full((15,), 2.0, dtype=torch.float64)
    push(server, 0, 0, grads_of(g0))
    assert call(server, 0, "pull", keys=[], min_version=1) == []
    clock.now += 2.0
    call(server, 0, "heartbeat")
    clock.now += 2.0  # worker 1 silent 4 s, worker 0 only 2 s
    (_, frames), = server.tick()
    assert decode(frames).get("version") == 1
    assert torch.equal(values(server), init - 0.5 * g0)  # the mean over the workers that pushed
    stats = server.stats()
    assert stats["live_workers"] == [0] and "worker 1 silent for 4.00 s" in stats["lost_workers"]["1"]
    assert "worker 1 was declared lost" in call(server, 1, "heartbeat")[0].get("error")
    assert call(server, 0, "heartbeat")[0].op == "ok"


def test_abort_answers_errors_naming_the_lost_worker():
    clock = FakeClock()
    server, init = make("sync", clock=clock, on_worker_loss="abort", worker_timeout_s=3.0, heartbeat_s=0.5)
    assert call(server, 0, "pull", keys=[], min_version=1) == []
    clock.now += 2.0
    call(server, 0, "heartbeat")
    clock.now += 2.0
    (_, frames), = server.tick()
    assert "aborted: worker 1 silent" in decode(frames).get("error")
    clock.now += 10.0  # worker 0 is silent too now, but the first cause stays the reported one
    assert server.tick() == []
    for op in ("heartbeat", "join", "stats"):
        assert "aborted: worker 1" in call(server, 0, op)[0].get("error")
    assert torch.equal(values(server), init)


def test_adam_chunks_match_whole_tensor_adam():
    """Elementwise optimizers give the same arithmetic on chunks as on whole tensors."""
    adam = lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)  # noqa: E731
    server, init = make("sync", workers=1, optimizer=adam)
    ref = init.clone()
    ref_opt = adam([ref])
    for step in range(5):
        g = torch.sin(torch.arange(15.0, dtype=torch.float64) + step)
        push(server, 0, step, grads_of(g))
        ref.grad = g
        ref_opt.step()
    assert torch.allclose(values(server), ref, rtol=0, atol=1e-14)


def test_checkpoint_stats_shutdown():
    server, init = make("async")
    ckpt = call(server, 0, "checkpoint")[0]
    assert ckpt.keys == KEYS and torch.equal(torch.cat(ckpt.tensors), init) and ckpt.get("version") == 0
    stats = call(server, 1, "stats")[0].get("body")
    assert stats["joins"] == 2 and stats["mode"] == "async" and stats["bytes_in"] > 0
    assert call(server, 0, "shutdown")[0].op == "ok" and server.stopped


def test_constructor_validates():
    values = split_values(LAYOUT, [torch.zeros(s.shape, dtype=torch.float64) for s in SPECS], 0)
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="mode"):
        ShardServer(0, LAYOUT, values, sgd, "bsp", 2)
    with pytest.raises(ValueError, match="values given for keys"):
        ShardServer(0, LAYOUT, {}, sgd, "sync", 2)
    with pytest.raises(ValueError, match="float64"):
        ShardServer(0, LAYOUT, {k: v.float() for k, v in values.items()}, sgd, "sync", 2)


def test_join_with_other_settings_is_refused_naming_each():
    """The shard compares what it runs with; settings only workers use are compared with the
    first worker that joined."""
    init = [torch.zeros(s.shape, dtype=torch.float64) for s in SPECS]
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, init, 0), lambda p: torch.optim.SGD(p, lr=0.1),
                         "sync", 3, PSConfig(), clock=FakeClock(), settings={"seed": 0, "optim.lr": 0.1})
    mine = {"seed": 0, "optim.lr": 0.1, "steps": 20}
    assert call(server, 0, "join", settings=mine)[0].op == "ok"
    err = call(server, 1, "join", settings={**mine, "seed": 3, "steps": 30})[0].get("error")
    assert "seed: worker 1 has 3, shard 0 has 0" in err and "steps: worker 1 has 30, worker 0 has 20" in err
    assert "optim.lr" not in err
    assert call(server, 2, "join", settings=mine)[0].op == "ok"
    assert server.stats()["joined_workers"] == [0, 2]


def test_sync_answers_a_keys_pull_as_soon_as_every_worker_pushed_it():
    """Per-key updates: once both workers pushed key k, a pull waiting for k is answered with
    its new values (version 1) while other keys of the step are still to come; the shard's
    step completes, counted once, when the last key is updated."""
    server, init = make("sync")
    assert len(KEYS) >= 3
    g0, g1 = torch.arange(15.0, dtype=torch.float64), torch.full((15,), 3.0, dtype=torch.float64)
    first, rest = KEYS[:1], KEYS[1:]
    push(server, 0, 0, grads_of(g0), keys=first)
    assert call(server, 0, "pull", keys=first, min_version=1) == []  # worker 1 has not pushed it
    assert call(server, 1, "pull", keys=[], min_version=1) == []  # all keys: waits for the step
    replies = push(server, 1, 0, grads_of(g1), keys=first)
    assert [r.op for r in replies] == ["ok", "ok"]
    early = replies[1]
    assert early.worker == 0 and early.keys == first and early.get("version") == 1
    expected = init - 0.5 * (g0 + g1) / 2
    k0 = LAYOUT.keys[first[0]]
    assert torch.equal(early.tensors[0], expected[:k0.numel])
    assert server.version == 0 and server.stats()["updates"] == 0
    push(server, 0, 0, grads_of(g0), keys=rest)
    replies = push(server, 1, 0, grads_of(g1), keys=rest)
    assert server.version == 1 and server.stats()["updates"] == 1
    whole = [r for r in replies if r.worker == 1 and r.keys]
    assert len(whole) == 1 and whole[0].get("version") == 1
    assert torch.equal(values(server), expected)  # the same as one step over all keys


def test_a_wait_is_answered_without_values_once_the_whole_step_is_done():
    """ps.exchange=phased: a wait names no keys; one key updated is not enough, the shard's
    step is; the reply carries the version and no tensors; unanswered, it times out naming
    what it waited for."""
    clock = FakeClock()
    server, _ = make("sync", clock=clock, timeout_s=5.0)
    g = torch.ones(15, dtype=torch.float64)
    first, rest = KEYS[:1], KEYS[1:]
    assert call(server, 0, "wait", min_version=1) == []
    push(server, 0, 0, grads_of(g), keys=first)
    assert [r.op for r in push(server, 1, 0, grads_of(g), keys=first)] == ["ok"]  # key 0 updated: not yet
    push(server, 0, 0, grads_of(g), keys=rest)
    replies = push(server, 1, 0, grads_of(g), keys=rest)
    done = [r for r in replies if r.worker == 0]
    assert len(done) == 1 and done[0].op == "ok" and done[0].get("version") == 1
    assert done[0].keys == [] and done[0].tensors == []
    assert call(server, 1, "wait", min_version=1)[0].get("version") == 1  # already done: at once
    assert call(server, 1, "wait", min_version=2) == []
    clock.now += 5.5
    (_, frames), = server.tick()
    err = decode(frames).get("error")
    assert "wait waited 5.50 s" in err and "version >= 2 (shard at version 1)" in err


def test_a_wait_without_min_version_is_refused():
    server, _ = make("sync")
    (reply,) = call(server, 0, "wait")
    assert reply.op == "error" and "min_version" in reply.get("error")


class QueueTransport:
    """recv() hands out queued (peer, frames); send() keeps the replies, decoded."""

    def __init__(self, items):
        self.items, self.sent = list(items), []

    def recv(self, timeout_s):
        return self.items.pop(0) if self.items else None

    def send(self, peer, frames):
        self.sent.append((peer, decode(frames)))


def _init_frames(worker=0, layout=LAYOUT, optim=None, keys=None, values=None):
    from ps.layout import split_values as split

    init = [torch.zeros(s.shape, dtype=torch.float64) for s in SPECS]
    vals = split(LAYOUT, init, 0)
    keys = [k.id for k in LAYOUT.shard_keys(0)] if keys is None else keys
    body = {"layout": layout if isinstance(layout, dict) else layout.to_wire(), "optim": optim or {"lr": 0.5}}
    return encode({"op": "init", "worker": worker, "req": 9, "body": body, "keys": keys},
                  values if values is not None else [vals[k] for k in keys])


def test_a_shard_without_a_model_takes_it_from_worker_0_and_refuses_everything_else():
    from ps.shard import await_init

    wire = LAYOUT.to_wire()
    bad_layout = dict(wire, num_shards=3)
    items = [(b"w1", encode({"op": "join", "worker": 1, "req": 1})),
             (b"w1", _init_frames(worker=1)),
             (b"w0", _init_frames(layout=bad_layout)),
             (b"w0", _init_frames(keys=KEYS[:1])),
             (b"w0", _init_frames(values=[torch.zeros(LAYOUT.keys[k].numel + 1, dtype=torch.float64) for k in KEYS])),
             (b"w0", _init_frames(optim={"lr": -1.0})),
             (b"w0", _init_frames()),
             (b"w1", encode({"op": "join", "worker": 1, "req": 2}))]
    made = []

    def make(layout, values, optim):
        if optim["lr"] <= 0:
            raise ValueError(f"optim.lr={optim['lr']}: must be > 0")
        server = ShardServer(0, layout, values, lambda p: torch.optim.SGD(p, lr=optim["lr"]), "sync", 2)
        made.append(server)
        return server

    transport = QueueTransport(items)
    server = await_init(transport, 0, 1, make, timeout_s=5.0)
    errors = [m.get("error") for _, m in transport.sent if m.op == "error"]
    codes = [m.get("code") for _, m in transport.sent if m.op == "error"]
    assert codes == ["not_initialized"] + [None] * 5 and "has no model yet" in errors[0]
    assert "init comes from worker 0, not worker 1" in errors[1]
    assert "the layout has 3 shards, this run 1" in errors[2] or "invalid layout" in errors[2]
    assert "expected this shard's keys" in errors[3]
    assert "does not match the layout's" in errors[4]
    assert "optim.lr=-1.0" in errors[5]
    assert transport.sent[-1][1].op == "ok" and server is made[0] and len(made) == 1
    assert torch.equal(server.chunks[KEYS[0]], torch.zeros_like(server.chunks[KEYS[0]]))
    assert transport.items  # the join after init is the server's to answer
    reply = decode(server.handle(b"w1", transport.items[0][1])[0][1])
    assert reply.op == "ok"
    assert "already has its model" in decode(server.handle(b"w1", _init_frames(worker=1))[0][1]).get("error")


def test_a_shard_without_a_model_gives_up_naming_worker_0():
    from ps.shard import await_init

    with pytest.raises(TimeoutError, match="worker 0 sent no init"):
        await_init(QueueTransport([]), 0, 1, lambda *a: None, timeout_s=0.3)


def test_a_push_carries_the_learning_rate_its_update_uses():
    """A script's schedule: sync updates with the step's lr (the same from every worker, or
    the push is refused); async with each push's own; a bad lr touches nothing."""
    server, init = make("sync", lr=0.5)
    g0, g1 = torch.arange(15.0, dtype=torch.float64), torch.ones(15, dtype=torch.float64)
    assert push(server, 0, 0, grads_of(g0), lr=0.1)[0].op == "ok"
    err = push(server, 1, 0, grads_of(g1), lr=0.2)[0]
    assert err.op == "error" and "lr=0.2, another worker with lr=0.1" in err.get("error")
    assert push(server, 1, 0, grads_of(g1), lr=0.1)[0].op == "ok"
    assert torch.allclose(values(server), init - 0.1 * (g0 + g1) / 2, rtol=0, atol=1e-15)

    server, init = make("async", lr=1.0, async_scale="sum")
    push(server, 0, 0, grads_of(g1), lr=0.25)
    assert torch.allclose(values(server), init - 0.25 * g1, rtol=0, atol=1e-15)
    for bad in (-1.0, float("nan"), "0.1", True):
        err = push(server, 0, 1, grads_of(g1), lr=bad)[0]
        assert err.op == "error" and "'lr'" in err.get("error"), bad
    assert torch.allclose(values(server), init - 0.25 * g1, rtol=0, atol=1e-15)


def test_a_held_step_is_updated_with_the_clip_every_worker_brings():
    """hold: the shard keeps the step's averaged gradient, gives its sum of squares (norm),
    and updates with the scale of the first pull; another scale, or a push without hold in a
    held step, is refused and changes nothing."""
    server, init = make("sync", lr=0.5)
    g0, g1 = torch.arange(15.0, dtype=torch.float64), torch.ones(15, dtype=torch.float64)
    assert push(server, 0, 0, grads_of(g0), hold=1)[0].op == "ok"
    assert call(server, 0, "norm", step=0) == []  # deferred: worker 1 has not pushed
    err = push(server, 1, 0, grads_of(g1))[0]
    assert err.op == "error" and "every worker must clip, or none" in err.get("error")
    replies = push(server, 1, 0, grads_of(g1), hold=1)
    mean = (g0 + g1) / 2
    (ok, norm) = replies
    assert ok.op == "ok" and norm.get("sq") == pytest.approx(float((mean ** 2).sum()), rel=1e-15)
    assert torch.equal(values(server), init) and server.version == 0  # held: nothing applied yet
    scale = 0.25
    (pulled,) = call(server, 0, "pull", keys=KEYS, min_version=1, scale=scale)
    assert server.version == 1 and torch.equal(torch.cat(pulled.tensors), init - 0.5 * (mean * scale))
    err = call(server, 1, "pull", keys=KEYS, min_version=1, scale=0.5)[0]
    assert err.op == "error" and "updated with 0.25" in err.get("error")
    assert call(server, 1, "pull", keys=KEYS, min_version=1, scale=scale)[0].op == "ok"
    for bad in (-1.0, float("inf"), "x"):
        err = call(server, 0, "pull", keys=KEYS, min_version=2, scale=bad)[0]
        assert err.op == "error" and "'scale'" in err.get("error")
    err = call(server, 0, "pull", keys=KEYS, min_version=2, scale=1.0)[0]  # step 1 holds nothing yet
    assert err.op == "error" and "holds no step to scale" in err.get("error")
    assert torch.equal(values(server), init - 0.5 * (mean * scale))


def test_a_request_from_a_worker_that_has_not_joined_is_refused_with_its_code():
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, [torch.zeros(s.shape, dtype=torch.float64) for s in SPECS], 0),
                         lambda p: torch.optim.SGD(p, lr=0.5), "sync", 2, PSConfig(), clock=FakeClock())
    (err,) = call(server, 1, "pull", keys=KEYS)
    assert err.op == "error" and err.get("code") == "not_joined" and "has not joined" in err.get("error")
