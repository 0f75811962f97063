"""Server shards serving in threads, clients over inproc:// (and tcp:// on 127.0.0.1)."""

import threading
import time

import pytest
import torch

from ps.client import PSClient, PSError, PeerTimeout, Result
from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, join_values, split_values
from ps.local import LocalCluster

SPECS = [ParamSpec("w", (8, 6), "float64"), ParamSpec("b", (6,), "float64"), ParamSpec("v", (10,), "float64")]
FAST = dict(timeout_s=5.0, heartbeat_s=0.05, worker_timeout_s=2.0)


def setup(num_shards=2, chunk_elems=7, seed=0):
    layout = build_layout(SPECS, num_shards, chunk_elems)
    gen = torch.Generator().manual_seed(seed)
    return layout, [torch.randn(s.shape, dtype=torch.float64, generator=gen) for s in SPECS]


def run_workers(fn, n):
    """fn(worker) in n threads; re-raise the first failure."""
    errors = []

    def target(w):
        try:
            fn(w)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a worker thread hung"


def shard_stats(client, key, timeout_s=5.0, until=lambda v: True):
    """Poll the shards' stats until until(sum of stats[key]) holds; return that sum."""
    deadline = time.monotonic() + timeout_s
    while True:
        total = sum(s[key] for s in client.stats())
        if until(total) or time.monotonic() > deadline:
            return total
        time.sleep(0.01)


@pytest.mark.timeout(30)
def test_pslite_n_pushes_sum():
    """ps-lite's test: N pushes of g to an async server with SGD lr=1 and no scaling give init - N*g."""
    layout, init = setup()
    workers, rounds = 3, 4
    g = torch.full((sum(s.numel for s in SPECS),), 0.25, dtype=torch.float64)
    cfg = PSConfig(async_scale="sum", **FAST)
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "async", workers, cfg) as cluster:
        def worker(w):
            with cluster.client(w) as c:
                c.join()
                grads = {k.id: g[:k.numel].clone() for k in layout.keys}
                for step in range(rounds):
                    assert c.wait(c.push(step, None, grads)).staleness >= 0
                    c.wait(c.pull())  # versions move on, so staleness is measured from here
        run_workers(worker, workers)
        with cluster.client(0) as c:
            c.join()
            versions, values = c.checkpoint()
            stats = c.stats()
    for got, start in zip(join_values(layout, values), init):
        assert torch.equal(got, start - workers * rounds * 0.25)
    assert versions == {0: 12, 1: 12}
    assert all(sum(s["staleness"].values()) == s["pushes"] == workers * rounds for s in stats)


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-2),
}


def fake_grads(params, worker, step):
    """A gradient that depends on the parameters, the worker and the step, like a real one."""
    gen = torch.Generator().manual_seed(1000 * worker + step)
    return [p * (0.3 + 0.1 * worker) + torch.randn(p.shape, dtype=p.dtype, generator=gen) for p in params]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sync_matches_local_averaged_steps(name):
    layout, init = setup()
    steps, workers, make_opt = 20, 2, OPTIMIZERS[name]
    local = [p.clone() for p in init]
    opt = make_opt(local)
    for step in range(steps):
        per_worker = [fake_grads(local, w, step) for w in range(workers)]
        for p, *gs in zip(local, *per_worker):
            p.grad = sum(gs) / workers
        opt.step()
    finals = {}
    with LocalCluster(layout, init, make_opt, "sync", workers, PSConfig(**FAST)) as cluster:
        def worker(w):
            with cluster.client(w) as c:
                _, version, values = c.join()
                params = join_values(layout, values)
                for step in range(version, version + steps):
                    push = c.push(step, step, split_values(layout, fake_grads(params, w, step)))
                    pull = c.pull(min_version=step + 1)  # in flight together with the push
                    c.wait(push)
                    result = c.wait(pull)
                    assert result.version == step + 1
                    params = join_values(layout, result.values)
                finals[w] = params
        run_workers(worker, workers)
    for w in range(workers):
        for got, want in zip(finals[w], local):
            assert (got - want).abs().max().item() <= 1e-12, (name, w)


@pytest.mark.timeout(20)
def test_wait_gives_one_result_type_for_every_kind_of_request():
    """push, push+pull, pull, wait (step_done), norm and checkpoint all give a Result, each
    with the fields its replies carry."""
    layout, init = setup()
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.5), "sync", 1, PSConfig(**FAST)) as cluster:
        with cluster.client(0) as c:
            c.join()
            ones = split_values(layout, [torch.ones(s.shape, dtype=torch.float64) for s in SPECS])
            pushed = c.wait(c.push(0, 0, ones))
            assert type(pushed) is Result and pushed.kind == "push" and pushed.staleness == 0 and not pushed.values
            done = c.wait(c.step_done())
            assert type(done) is Result and done.versions == {0: 1, 1: 1} and done.version == 1
            pulled = c.wait(c.pull())
            assert type(pulled) is Result and pulled.version == 1 and set(pulled.values) == set(ones)
            both = c.wait(c.push(1, 1, ones, pull=True, next_version=True))
            assert both.kind == "push+pull" and both.version == 2 and set(both.values) == set(ones)
            for got, start in zip(join_values(layout, both.values), init):
                assert torch.allclose(got, start - 1.0, rtol=0, atol=1e-15)
            held = c.push(2, 2, ones, hold=True)
            sums = c.wait(c.norm())
            c.wait(held)
            assert type(sums) is Result and set(sums.sq) == {0, 1}
            assert sum(sums.sq.values()) == pytest.approx(sum(float(g.pow(2).sum()) for g in ones.values()))
            c.wait(c.pull(next_version=True, scale=1.0))
            versions, values = c.checkpoint()
            assert versions == {0: 3, 1: 3} and set(values) == set(ones)


@pytest.mark.timeout(20)
def test_pull_with_min_version_waits_for_the_step():
    layout, init = setup()
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.1), "sync", 2, PSConfig(**FAST)) as cluster:
        with cluster.client(0) as c0, cluster.client(1) as c1:
            c0.join(), c1.join()
            grads = split_values(layout, [torch.ones(s.shape, dtype=torch.float64) for s in SPECS])
            c0.wait(c0.push(0, 0, grads))
            pull = c0.pull(min_version=1)
            assert shard_stats(c1, "deferred", until=lambda n: n == 2) == 2  # held on both shards
            assert not c0.ready(pull)
            c1.wait(c1.push(0, 0, grads))
            result = c0.wait(pull)
            assert result.version == 1 and result.versions == {0: 1, 1: 1}
            for got, start in zip(join_values(layout, result.values), init):
                assert torch.allclose(got, start - 0.1, rtol=0, atol=1e-15)
            assert shard_stats(c1, "deferred") == 0
            assert all(s["queue_wait"]["count"] == 1 and s["queue_wait"]["max_s"] > 0 for s in c1.stats())


@pytest.mark.timeout(20)
@pytest.mark.parametrize("staleness", [0, 1])
def test_ssp_fast_worker_blocks_until_slow_one_catches_up(staleness):
    layout, init = setup()
    cfg = PSConfig(staleness=staleness, **FAST)
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.1), "ssp", 2, cfg) as cluster:
        with cluster.client(0) as fast, cluster.client(1) as slow:
            fast.join(), slow.join()
            grads = split_values(layout, [torch.ones(s.shape, dtype=torch.float64) for s in SPECS])
            for clock in range(1, staleness + 2):
                fast.wait(fast.push(clock - 1, None, grads))
                pull = fast.pull(clock=clock)
                if clock <= staleness:  # within the bound: answered at once
                    fast.wait(pull, timeout_s=2.0)
                    continue
                assert shard_stats(slow, "deferred", until=lambda n: n == 2) == 2
                assert not fast.ready(pull)
                slow.wait(slow.push(0, None, grads))  # the slow worker reaches clock 1
                fast.wait(pull)
                for stats in slow.stats():
                    clocks = stats["clocks"]
                    assert clocks == {"0": clock, "1": 1}
                    assert clock - min(clocks.values()) <= staleness


def _lose_worker_1(policy):
    layout, init = setup(num_shards=1)
    cfg = PSConfig(on_worker_loss=policy, timeout_s=5.0, heartbeat_s=0.05, worker_timeout_s=0.5)
    cluster = LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.5), "sync", 2, cfg)
    c0, c1 = cluster.client(0), cluster.client(1)
    c1.join()
    c1.close()  # no more heartbeats from worker 1
    c0.join()
    grads = split_values(layout, [torch.full(s.shape, 2.0, dtype=torch.float64) for s in SPECS])
    c0.wait(c0.push(0, 0, grads))
    return cluster, c0, layout, init


@pytest.mark.timeout(20)
def test_silent_worker_is_dropped():
    cluster, c0, layout, init = _lose_worker_1("drop")
    try:
        result = c0.wait(c0.pull(min_version=1))  # completes once worker 1 is dropped
        for got, start in zip(join_values(layout, result.values), init):
            assert torch.equal(got, start - 0.5 * 2.0)
        time.sleep(0.8)  # longer than worker_timeout_s: heartbeats alone keep worker 0 alive
        stats, = c0.stats()
        assert stats["live_workers"] == [0] and list(stats["lost_workers"]) == ["1"]
        assert "worker 1 silent" in stats["lost_workers"]["1"]
        with cluster.client(1) as again, pytest.raises(PSError, match="worker 1 was declared lost"):
            again.join()
    finally:
        c0.close()
        cluster.stop()


@pytest.mark.timeout(20)
def test_silent_worker_aborts_the_run():
    cluster, c0, _, _ = _lose_worker_1("abort")
    try:
        with pytest.raises(PSError, match=r"aborted: worker 1 silent") as info:
            c0.wait(c0.pull(min_version=1))
        assert cluster.addresses[0] in str(info.value)
        assert cluster.join(5.0), "the serve loop should end after an abort"
        assert cluster.results[0].startswith("shard 0 aborted: worker 1")
    finally:
        c0.close()
        cluster.stop()


@pytest.mark.timeout(20)
def test_tcp_loopback_ephemeral_ports():
    layout, init = setup()
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", 1, PSConfig(**FAST),
                      address="tcp") as cluster:
        assert all(a.startswith("tcp://127.0.0.1:") and not a.endswith("*") for a in cluster.addresses)
        with cluster.client(0) as c:
            _, version, values = c.join()
            assert version == 0 and all(torch.equal(a, b) for a, b in zip(join_values(layout, values), init))
            grads = split_values(layout, [torch.full(s.shape, 0.5, dtype=torch.float64) for s in SPECS])
            c.wait(c.push(0, 0, grads))
            result = c.wait(c.pull(min_version=1))
            assert all(torch.equal(a, b - 0.5) for a, b in zip(join_values(layout, result.values), init))
            assert c.bytes_sent > 8 * sum(s.numel for s in SPECS) and c.bytes_recv > c.bytes_sent
            c.shutdown()
        assert cluster.join(5.0) and set(cluster.results.values()) == {"shutdown"}


@pytest.mark.timeout(20)
def test_socket_refuses_oversized_message():
    specs = [ParamSpec("big", (4000,), "float64")]
    layout = build_layout(specs, 1, 1 << 20)
    init = [torch.zeros(4000, dtype=torch.float64)]
    cfg = PSConfig(max_message_mb=0.001, timeout_s=0.5, heartbeat_s=0.05, worker_timeout_s=5.0)
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "async", 1, cfg, address="tcp") as cluster:
        with cluster.client(0) as c:
            c.join()  # the reply is big, but only inbound messages are bounded
            with pytest.raises(PeerTimeout, match=cluster.addresses[0]):
                c.wait(c.push(0, None, {0: torch.ones(4000, dtype=torch.float64)}))
            c.timeout_s = 5.0
            _, values = c.checkpoint()  # the shard still serves, and nothing was applied
            assert not values[0].any()


@pytest.mark.timeout(10)
def test_timeouts_and_error_replies_name_the_server():
    with pytest.raises(PeerTimeout, match="inproc://psar-nobody-home"):
        with PSClient(["inproc://psar-nobody-home"], 0, timeout_s=0.2) as c:
            c.join()
    layout, init = setup()
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", 1, PSConfig(**FAST)) as cluster:
        with cluster.client(0) as c:
            c.join()
            grads = split_values(layout, [torch.ones(s.shape, dtype=torch.float64) for s in SPECS])
            with pytest.raises(PSError, match=r"inproc://psar-.*-shard\d \(shard \d\) refused push .*at step 0"):
                c.wait(c.push(3, 0, grads))
            with pytest.raises(ValueError, match="key 99"):
                c.push(0, 0, {99: torch.ones(1)})


@pytest.mark.timeout(20)
def test_restart_of_another_shard_is_noticed_while_waiting_on_one():
    """A worker waiting on shard 0 alone (its pull held for the other worker's push) learns at
    once that shard 1 restarted and forgot it: the other worker cannot step until it rejoins,
    so the wait could only end in a timeout. After rejoining, answers to heartbeats sent
    before the join do not count as a second restart."""
    layout, init = setup()
    shard0 = [k.id for k in layout.shard_keys(0)]
    # tcp: a DEALER reconnects to a new socket bound on the same tcp address, not on inproc.
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.1), "sync", 2, PSConfig(**FAST),
                      address="tcp") as cluster:
        with cluster.client(0) as c0:
            c0.join()
            grads = split_values(layout, [torch.ones(s.shape, dtype=torch.float64) for s in SPECS])
            c0.wait(c0.push(0, 0, grads))
            pull = c0.pull(keys=shard0, min_version=1)  # held: worker 1 has not pushed
            cluster.restart(1)
            started = time.monotonic()
            with pytest.raises(PSError, match=r"shard 1\) restarted and no longer knows this worker"):
                c0.wait(pull)
            # Without the heartbeats' news the wait ends at the pull's timeout (timeout_s).
            assert time.monotonic() - started < FAST["timeout_s"] / 2, "noticed only when the pull timed out"
            c0.abandon()
            c0.join()
            time.sleep(20 * FAST["heartbeat_s"])  # late answers to earlier heartbeats arrive
            assert not c0.forgotten
            c0.wait(c0.pull(keys=shard0))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("compression,tol", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_compressed_wire_halves_the_bytes_and_keeps_float32_masters(compression, tol):
    """float32 parameters, pushes and pulls in 16 bits: 10 sync steps of 2 workers end within
    `tol` (relative) of the uncompressed run; the shards' values stay float32 and the final
    pull (wait_left) brings them exactly; the push bytes are half."""
    specs = [ParamSpec("w", (64, 32), "float32"), ParamSpec("b", (32,), "float32")]
    layout = build_layout(specs, 2, 512)
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s.shape, generator=gen) for s in specs]
    grads = [[torch.randn(sum(s.numel for s in specs), generator=gen) for _ in range(10)] for _ in range(2)]
    finals, bytes_in = {}, {}
    for wire in ("none", compression):
        cfg = PSConfig(compression=wire, **FAST)
        with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sync", 2, cfg) as cl:
            def worker(w):
                with cl.client(w) as c:
                    c.join()
                    for step in range(10):
                        flat = grads[w][step]
                        c.wait(c.push(None, None, {k.id: flat[k.offset + (0 if k.param == 0 else 2048):][:k.numel]
                                                   for k in layout.keys}))
                        pulled = c.wait(c.pull(next_version=True))
                        assert all(t.dtype == (torch.float32 if wire == "none" else getattr(torch, cfg.wire_dtype))
                                   for t in pulled.values.values())
                    if w == 0:
                        final = c.wait_alive(c.pull(wait_left=True))
                        finals[wire] = torch.cat([final.values[k.id] for k in layout.keys])
                    c.leave()
            run_workers(worker, 2)
            assert all(s.chunks[k].dtype == torch.float32 for s in cl.servers for k in s.chunks)
            masters = torch.cat([cl.servers[k.shard].chunks[k.id] for k in layout.keys])
            bytes_in[wire] = sum(s.counters["bytes_in"] for s in cl.servers)
    assert torch.equal(finals[compression], masters)  # the final pull is exact
    assert finals[compression].dtype == torch.float32
    rel = (finals[compression] - finals["none"]).abs().max() / finals["none"].abs().max()
    print(f"{compression}: relative difference {rel:.2e}, bytes in {bytes_in[compression] / bytes_in['none']:.3f}x")
    assert 0 < rel < tol, rel
    assert bytes_in[compression] < 0.6 * bytes_in["none"]


@pytest.mark.timeout(60)
def test_a_large_parameter_leaves_in_pieces_and_is_updated_as_one_step_would():
    """A parameter of several keys leaves as a message per ps.bucket_kb, even between its own
    keys, so a shard can answer its first pieces while later ones arrive; the update is a
    plain SGD step all the same (float64)."""
    from ps.engine import PSEngine
    from ps.layout import chunk_elems_from_mb

    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512).double()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = PSConfig(chunk_mb=0.25, bucket_kb=256, **FAST)
    specs = [ParamSpec.of(n, p) for n, p in model.named_parameters()]
    layout = build_layout(specs, 2, chunk_elems_from_mb(cfg.chunk_mb, 8))
    assert len(layout.param_keys(0)) == 8  # the 2 MiB weight: 8 keys of 256 KiB, 4 a shard
    x, y = torch.randn(16, 512, dtype=torch.float64), torch.randn(16, 512, dtype=torch.float64)
    sent = []
    with LocalCluster(layout, before, lambda p: torch.optim.SGD(p, lr=0.1), "sync", 1, cfg) as cluster:
        engine = PSEngine(0, 1, torch.device("cpu"), cluster.addresses, "sync", cfg,
                          trace=lambda name, *a, **k: sent.append(name))
        engine.attach(model, None)
        engine.backward(torch.nn.functional.mse_loss(model(x), y))
        engine.step()
        engine.close()
    pushes = [n for n in sent if n.startswith("push+pull")]
    assert len(pushes) >= 8, pushes  # a message per key of the weight (before: one per shard)
    reference = torch.nn.Linear(512, 512).double()
    with torch.no_grad():
        for p, b in zip(reference.parameters(), before):
            p.copy_(b)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, r - 0.1 * r.grad, rtol=0, atol=1e-12)


def _three_keys():
    specs = [ParamSpec(n, (64,), "float64") for n in "abc"]
    layout = build_layout(specs, 1, 1 << 20)
    return layout, [torch.zeros(64, dtype=torch.float64) for _ in specs]


@pytest.mark.timeout(30)
def test_the_window_holds_push_pulls_until_the_shard_answers():
    """With room for one push+pull, a worker's later ones wait on the worker until the shard
    answers the first, which it does once the other worker has pushed that key too."""
    layout, init = _three_keys()
    g = torch.ones(64, dtype=torch.float64)
    one = 600 / (1 << 20)  # a message of one 64-value key fits; two do not
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", 2, PSConfig(**FAST)) as cluster:
        c0, c1 = cluster.client(0, window_mb=one), cluster.client(1, window_mb=one)
        c0.join(), c1.join()
        first = [c0.push(None, None, {k: g}, pull=True, next_version=True) for k in range(3)]
        # The first arrives (stats travel on another connection, so wait for it); two stay on
        # worker 0, which reads no reply until it waits.
        assert shard_stats(c1, "pushes", until=lambda n: n >= 1) == 1
        time.sleep(0.2)
        assert sum(s["pushes"] for s in c1.stats()) == 1
        second = [c1.push(None, None, {k: g}, pull=True, next_version=True) for k in range(3)]
        results = {}
        run_workers(lambda w: results.setdefault(w, [(c0, c1)[w].wait(h) for h in (first, second)[w]]), 2)
        for w in (0, 1):
            assert [r.versions[0] for r in results[w]] == [1, 1, 1]
            assert all(torch.equal(v, -g) for r in results[w] for v in r.values.values())
        c0.close(), c1.close()


@pytest.mark.timeout(30)
def test_workers_whose_keys_leave_in_other_orders_never_wait_on_each_other():
    """Worker 0 pushes keys 0, 1, 2 and worker 1 pushes 2, 1, 0, each with room for one: each
    holds what the other needs, until a wait that hears nothing sends the next one anyway."""
    layout, init = _three_keys()
    g = torch.ones(64, dtype=torch.float64)
    one = 600 / (1 << 20)
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", 2, PSConfig(**FAST)) as cluster:
        clients = [cluster.client(w, window_mb=one) for w in (0, 1)]
        for c in clients:
            c.join()
        orders = ([0, 1, 2], [2, 1, 0])
        handles = [[c.push(None, None, {k: g}, pull=True, next_version=True) for k in order]
                   for c, order in zip(clients, orders)]
        results = {}
        run_workers(lambda w: results.setdefault(w, [clients[w].wait(h) for h in handles[w]]), 2)
        for w in (0, 1):
            assert all(torch.equal(v, -g) for r in results[w] for v in r.values.values())
        for c in clients:
            c.close()


@pytest.mark.timeout(30)
def test_a_refused_push_pull_takes_what_the_window_holds_of_it_along():
    """A push+pull that one shard refuses fails, and its part the window still held for
    another shard is dropped, not sent later."""
    layout = build_layout([ParamSpec(n, (64,), "float64") for n in "ab"], 2, 1 << 20)
    assert [k.shard for k in layout.keys] == [0, 1]
    init = [torch.zeros(64, dtype=torch.float64) for _ in "ab"]
    g = torch.ones(64, dtype=torch.float64)
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", 2, PSConfig(**FAST)) as cluster:
        c0 = cluster.client(0, window_mb=600 / (1 << 20))
        c0.join()
        c0.push(None, None, {1: g}, pull=True, next_version=True)  # unanswered: fills shard 1's window
        bad = c0.push(5, None, {0: g, 1: g}, pull=True)  # shard 0 refuses step 5; shard 1's part is held
        assert [len(c0._held[s]) for s in (0, 1)] == [0, 1]
        with pytest.raises(PSError, match="step 5"):
            c0.wait(bad)
        assert not any(c0._held.values())
        c0.close()
