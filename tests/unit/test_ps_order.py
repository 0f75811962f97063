"""ps.order=forward (ps/engine.py, ps/client.py): the push+pulls a worker's window holds back
leave first-layer keys first, and the next forward takes each module's values in its own
forward pre-hook, so it starts before the last layer's are in; the parameters stay those of
ps.order=arrival bit for bit. Real shards in threads (ps.local.LocalCluster, inproc://)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ps.config import PSConfig, forward_window, sync_window
from ps.engine import PSEngine
from ps.layout import ParamSpec, build_layout
from ps.local import LocalCluster
from experiments.settings.presets import build_config

from tests.unit.test_ps_bucketing import FAST, batch, chain

pytestmark = pytest.mark.timeout(60)


def _layout(model, shards: int = 1):
    return build_layout([ParamSpec.of(n, p) for n, p in model.named_parameters()], shards, 1 << 20)


def _train(order: str, window_mb: float, steps: int = 4, workers: int = 2) -> tuple[list[torch.Tensor], list[dict]]:
    """`workers` engines on chain() in threads, one shard, SGD with momentum; rank 0's
    parameters after `steps` steps (each worker's batch scaled by its rank), and what its
    step() returned each step."""
    models = [chain() for _ in range(workers)]
    layout = _layout(models[0])
    params = [p.detach().clone() for p in models[0].parameters()]
    config = PSConfig(order=order, window_mb=window_mb, bucket_kb=0, **FAST)
    with LocalCluster(layout, params, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sync", workers,
                      config) as cluster:
        engines = [PSEngine(w, workers, torch.device("cpu"), cluster.addresses, "sync", config) for w in range(workers)]

        stats = []

        def work(w):
            engines[w].attach(models[w], None)
            x, y = batch()
            for _ in range(steps):
                loss = torch.nn.functional.mse_loss(models[w](x * (w + 1)), y)
                engines[w].backward(loss)
                out = engines[w].step()
                if w == 0:
                    stats.append(out)
            engines[w].close()

        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
        assert not any(t.is_alive() for t in threads), "a worker hung"
    return [p.detach().clone() for p in models[0].parameters()], stats


@pytest.mark.parametrize("window_mb", [3.0, 600 / (1 << 20)])  # everything at once; one key at a time
def test_forward_order_gives_the_parameters_of_arrival_order_bit_for_bit(window_mb):
    arrival, arrival_stats = _train("arrival", window_mb)
    forward, forward_stats = _train("forward", window_mb)
    assert all(torch.equal(a, f) for a, f in zip(arrival, forward))
    assert all(p.dtype == torch.float64 for p in forward)
    assert not torch.equal(arrival[0], chain().state_dict()["0.weight"])  # it trained
    # Each step counts the values it pulled (3.5 KiB), though the next forward reads them;
    # only the replies' headers (tens of bytes, their sizes vary) land a step later.
    assert [s["bytes_sent"] for s in forward_stats] == [s["bytes_sent"] for s in arrival_stats]
    assert all(abs(f["bytes_recv"] - a["bytes_recv"]) < 256 for f, a in zip(forward_stats[1:], arrival_stats[1:]))
    assert 0 < arrival_stats[0]["bytes_recv"] - forward_stats[0]["bytes_recv"] < 1024


def test_the_window_lets_the_lowest_priority_out_first():
    """Room for one key: worker 0 pushes keys 2, 1, 0 (priority = key); once the shard answers
    key 2 (worker 1 pushed it too), key 0 leaves before key 1."""
    model = chain()
    layout = _layout(model)
    init = [p.detach().clone() for p in model.parameters()]
    def grad(k):  # each push its own tensor: in-process, a shard sums into the frame it received
        return torch.ones(layout.keys[k].numel, dtype=torch.float64)

    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=1.0), "sync", 2, PSConfig(**FAST)) as cluster:
        c0, c1 = cluster.client(0, window_mb=2100 / (1 << 20)), cluster.client(1)  # key 1 is 2 KiB
        c0.join(), c1.join()
        left = []
        send = c0._send
        c0._send = lambda s, req, frames, nbytes, counted=False: (left.append(req), send(s, req, frames, nbytes, counted))
        handles = {k: c0.push(None, None, {k: grad(k)}, pull=True, next_version=True, priority=k) for k in (2, 1, 0)}
        req_of = {k: next(iter(h.pending)) for k, h in handles.items()}
        assert left == [req_of[2]]  # keys 1 and 0 wait on the worker
        others = [c1.push(None, None, {2: grad(2)}, pull=True, next_version=True)]
        c0.wait(handles[2])
        assert left == [req_of[2], req_of[0]]  # key 0 passed key 1
        others += [c1.push(None, None, {k: grad(k)}, pull=True, next_version=True) for k in (1, 0)]
        for k in (0, 1):
            assert c0.wait(handles[k]).version == 1
        assert left == [req_of[2], req_of[0], req_of[1]]
        assert all(c1.wait(h).version == 1 for h in others)
        c0.close(), c1.close()


def test_the_next_forward_starts_before_the_last_layers_values_are_in():
    """Worker 1 has pushed only the first weight of step 1: worker 0's step() returns at once,
    and its next forward runs the first layer, then waits in the last one's pre-hook until
    worker 1 pushes the rest; its output is then the one of the new values."""
    models = [chain(), chain()]
    layout = _layout(models[0])
    init = [p.detach().clone() for p in models[0].parameters()]
    config = PSConfig(order="forward", bucket_kb=0, **FAST)
    with LocalCluster(layout, init, lambda p: torch.optim.SGD(p, lr=0.1), "sync", 2, config) as cluster:
        engine = PSEngine(0, 2, torch.device("cpu"), cluster.addresses, "sync", config)
        engine.attach(models[0], None)
        other = cluster.client(1)
        other.join()
        x, y = batch()
        engine.backward(torch.nn.functional.mse_loss(models[0](x), y))
        grads = {k.id: torch.full((k.numel,), 0.5, dtype=torch.float64) for k in layout.keys}
        first = other.push(None, None, {0: grads[0]}, pull=True, next_version=True)
        started = time.perf_counter()
        engine.step()
        assert time.perf_counter() - started < 1.0  # it did not wait for worker 1's other keys
        ran = []
        models[0][0].register_forward_hook(lambda *_: ran.append("first layer"))
        out = {}
        forward = threading.Thread(target=lambda: out.setdefault("y", models[0](x)))
        forward.start()
        deadline = time.monotonic() + 10
        while not ran and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ran == ["first layer"] and forward.is_alive()  # waiting for the last weights' values
        rest = other.push(None, None, {1: grads[1], 2: grads[2]}, pull=True, next_version=True)
        forward.join(10)
        assert not forward.is_alive()
        values = {**other.wait(first).values, **other.wait(rest).values}
        for k in layout.keys:
            param = list(models[0].parameters())[k.param]
            assert torch.equal(param.detach().reshape(-1)[k.offset: k.offset + k.numel], values[k.id])
        with torch.no_grad():
            assert torch.equal(out["y"], models[0](x))
        engine.backward(torch.nn.functional.mse_loss(out["y"], y))
        second = other.push(None, None, grads, pull=True, next_version=True)
        stats = engine.step()
        assert stats["in_backward_s"] > 0  # the forward's wait is communication, not compute
        other.wait(second)
        other.leave()
        other.close()
        engine.close()


def test_the_window_shrinks_to_what_the_link_carries_in_20_ms():
    assert forward_window(3.0, 512.0, None) == (3.0, 512.0)  # unknown rate: as given
    assert forward_window(0.0, 512.0, 200e6) == (0.0, 512.0)  # no window stays none
    window, bucket = forward_window(3.0, 512.0, 200e6)
    assert window == pytest.approx(200e6 / 8 * 0.02 / (1 << 20)) and bucket == pytest.approx(window * 256)
    assert forward_window(3.0, 512.0, 10e9) == (3.0, 512.0)  # at most ps.window_mb


def test_the_window_holds_at_least_four_keys():
    """At 100mbit 20 ms is 0.24 MiB, under two keys of 1/8 MiB (stop and wait): four keys."""
    assert forward_window(3.0, 512.0, 100e6, key=0.125) == (0.5, 128.0)
    window, _ = forward_window(3.0, 512.0, 1e9, key=0.5)  # 20 ms of 1gbit: 2.38 MiB, over 4 keys
    assert window == pytest.approx(1e9 / 8 * 0.02 / (1 << 20))


def test_a_sync_worker_never_stops_and_waits_on_its_keys():
    """Where the rate is unknown, or fast, keys are 4 MiB: the 3 MiB default held one at a time."""
    assert sync_window(3.0, 512.0, 4.0) == (16.0, 512.0)  # loopback: 4 keys of 4 MiB
    assert sync_window(3.0, 512.0, 4.0, 10e9) == (16.0, 512.0)  # 10gbit: forward_window's 3 MiB, then 4 keys
    assert sync_window(3.0, 512.0, 0.125, 100e6) == forward_window(3.0, 512.0, 100e6, key=0.125)
    assert sync_window(0.0, 512.0, 4.0) == (0.0, 512.0)  # no window stays none
    assert sync_window(3.0, 512.0, 0.5, 200e6, order="arrival") == (3.0, 512.0)  # arrival: as given, 6 keys
    for net in ((), ("net.rate=10gbit",)):
        cfg = build_config("mlp-wide", net, engine="ps-sync", workers=2)
        assert cfg.key_mb() == 4.0 and cfg.worker_ps().window_mb == 16.0, net
    assert build_config("mlp-wide", (), engine="ps-async", workers=2).worker_ps().window_mb == 3.0  # sync only
