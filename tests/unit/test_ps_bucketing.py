"""The parameter server's worker-side bucketing (ps/engine.py: PSEngine._enqueue, _flush):
which keys leave together, when a bucket flushes (ps.bucket_kb), how a parameter is cut
into keys (ps.chunk_mb) and a bucket into one message per shard, in which order, and what
each message asks back. A real PSEngine and real shards in threads (ps.local.LocalCluster,
inproc://); every message the worker's client sends is recorded as it leaves."""

from __future__ import annotations

import pytest
import torch

from ps.config import PSConfig, key_mb
from ps.engine import PSEngine
from ps.layout import ParamSpec, build_layout, chunk_elems_from_mb
from ps.local import LocalCluster

pytestmark = pytest.mark.timeout(30)

FAST = dict(timeout_s=5.0, heartbeat_s=0.05, worker_timeout_s=2.0)
KIB = 1 / 1024  # bucket_kb of this many KiB is one byte
KEY_64 = 64 * 8 / (1 << 20)  # chunk_mb of 64 float64 elements (512 bytes)


def chain(unused: bool = False) -> torch.nn.Module:
    """Three float64 weights of 1 KiB, 2 KiB and 0.5 KiB, used one after the other, so that
    backward produces their gradients strictly last to first (and an unused fourth)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16, bias=False), torch.nn.Tanh(), torch.nn.Linear(16, 16, bias=False),
              torch.nn.Tanh(), torch.nn.Linear(16, 4, bias=False)]
    model = torch.nn.Sequential(*layers).double()
    if unused:
        model.register_parameter("spare", torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    return model


def batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(5, 4, generator=gen, dtype=torch.float64)


class Run:
    """One worker's engine on `shards` shards; records each message its client sends:
    (kind, shard, header, tensors as they left)."""

    def __init__(self, model, config: PSConfig, mode: str = "sync", shards: int = 1) -> None:
        self.model, self.sent = model, []
        specs = [ParamSpec.of(n, p) for n, p in model.named_parameters()]
        # As the shards' layout is cut (experiments/sparsity.py): keys of ps.chunk_mb (0: 4 MiB).
        self.layout = build_layout(specs, shards, chunk_elems_from_mb(key_mb(config.chunk_mb), 8))
        params = [p.detach().clone() for p in model.parameters()]
        self.cluster = LocalCluster(self.layout, params, lambda p: torch.optim.SGD(p, lr=0.1), mode, 1, config)
        self.engine = PSEngine(0, 1, torch.device("cpu"), self.cluster.addresses, mode, config)
        self.engine.attach(model, None)
        start = self.engine.client._start
        self.engine.client._lane = None  # every message through _start (the lane's bytes: test_client_compiled)

        def recording(kind, per_shard, conditional=False, priority=None):
            for shard, (header, tensors, *_) in per_shard.items():
                self.sent.append((kind, shard, dict(header), [t.clone() for t in tensors or ()]))
            return start(kind, per_shard, conditional, priority)
        self.engine.client._start = recording

    def backward(self):
        x, y = batch()
        self.engine.backward(torch.nn.functional.mse_loss(self.model(x), y))
        self.stepped = False

    def step(self):
        self.engine.step()
        self.stepped = True

    def pushes(self):
        return [(kind, shard, header["keys"]) for kind, shard, header, _ in self.sent if kind.startswith("push")]

    def close(self):
        try:
            if not getattr(self, "stepped", True):
                self.engine.step()
            self.engine.close()
        finally:
            self.cluster.stop()


@pytest.fixture
def runs():
    made = []
    yield lambda *a, **k: made.append(Run(*a, **k)) or made[-1]
    for run in made:
        run.close()


def test_the_chains_layout():
    """The key ids the other tests name: one key per weight, or 64-element keys."""
    specs = [ParamSpec.of(n, p) for n, p in chain().named_parameters()]
    assert [s.numel * 8 for s in specs] == [1024, 2048, 512]
    whole = build_layout(specs, 1, chunk_elems_from_mb(4.0, 8))
    assert [(k.param, k.numel) for k in whole.keys] == [(0, 128), (1, 256), (2, 64)]
    cut = build_layout(specs, 2, chunk_elems_from_mb(KEY_64, 8))
    assert [(k.param, k.numel) for k in cut.keys] == [(0, 64)] * 2 + [(1, 64)] * 4 + [(2, 64)]


# bucket_kb -> the keys of each message, in the order they leave (one shard, a key a weight;
# backward gives weight 2 (0.5 KiB), then 1 (2 KiB), then 0 (1 KiB)).
WHOLE_KEYS = [
    (0, [[2], [1], [0]]),          # each key as soon as its gradient is there
    (0.5, [[2], [1], [0]]),        # a bucket that reaches bucket_kb exactly leaves
    (0.5 + KIB, [[2, 1], [0]]),    # one byte more: weight 2 waits for weight 1
    (2.5, [[2, 1], [0]]),          # 2 + 0.5 KiB leave; weight 0 leaves at the end of backward
    (2.5 + KIB, [[2, 1, 0]]),      # all three fill it together
    (512, [[2, 1, 0]]),            # the default: everything in one message after backward
]


@pytest.mark.parametrize("bucket_kb,messages", WHOLE_KEYS)
def test_keys_leave_together_until_a_bucket_holds_bucket_kb(runs, bucket_kb, messages):
    run = runs(chain(), PSConfig(bucket_kb=bucket_kb, **FAST))
    run.backward()
    assert run.pushes() == [("push+pull", 0, keys) for keys in messages]  # all sent inside backward
    run.step()
    assert len(run.pushes()) == len(messages)  # step() adds none: nothing was left behind


# Keys of 64 elements (ps.chunk_mb) over two shards; bucket_kb -> the buckets' keys in order.
CUT_KEYS = [
    (0, [[6], [2], [3], [4], [5], [0], [1]]),
    (1, [[6, 2], [3, 4], [5, 0], [1]]),  # weight 1 (2 KiB) is cut between its own keys
    (1.5, [[6, 2, 3], [4, 5, 0], [1]]),
    (4, [[6, 2, 3, 4, 5, 0, 1]]),
]


@pytest.mark.parametrize("bucket_kb,buckets", CUT_KEYS)
def test_a_parameter_larger_than_a_bucket_leaves_in_pieces_one_message_per_shard(runs, bucket_kb, buckets):
    run = runs(chain(), PSConfig(chunk_mb=KEY_64, bucket_kb=bucket_kb, **FAST), shards=2)
    shard_of = {k.id: k.shard for k in run.layout.keys}
    assert shard_of == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1, 6: 0}  # keys of equal size alternate
    run.backward()
    expected = []
    for keys in buckets:  # a bucket is one message to each shard that holds some of its keys
        for shard in dict.fromkeys(shard_of[k] for k in keys):  # shards as its keys first name them
            expected.append(("push+pull", shard, [k for k in keys if shard_of[k] == shard]))
    assert run.pushes() == expected  # bucket after bucket in backward's order, all inside backward


def test_each_message_carries_the_gradient_of_its_keys(runs):
    run = runs(chain(), PSConfig(chunk_mb=KEY_64, bucket_kb=1, **FAST), shards=2)
    run.backward()
    reference = chain()
    x, y = batch()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    grads = [p.grad.reshape(-1) for p in reference.parameters()]
    seen = set()
    for kind, shard, header, tensors in run.sent:
        assert len(tensors) == len(header["keys"])
        for k, tensor in zip(header["keys"], tensors):
            key = run.layout.keys[k]
            assert key.shard == shard
            assert torch.equal(tensor, grads[key.param][key.offset:key.offset + key.numel])
            seen.add(k)
    assert seen == set(range(7))  # every key once


@pytest.mark.parametrize("mode,exchange,kinds,ask", [
    ("sync", "pipelined", ["push+pull"], {"pull": 1, "min_version": 1}),  # the bucket's next values
    ("sync", "phased", ["push"], {}),  # the values come in one pull once every shard is done
    ("async", "pipelined", ["push+pull"], {"pull": 1, "clock": 1}),  # its values once applied
    ("ssp", "pipelined", ["push+pull"], {"pull": 1, "clock": 1}),
])
def test_what_a_bucket_asks_back_follows_the_mode(runs, mode, exchange, kinds, ask):
    run = runs(chain(), PSConfig(bucket_kb=0.5 + KIB, exchange=exchange, **FAST), mode=mode)
    run.backward()
    sent = [(kind, header) for kind, _, header, _ in run.sent]
    assert [kind for kind, _ in sent] == kinds * 2  # two buckets: [2, 1] and [0]
    for _, header in sent:
        assert {k: header[k] for k in ("pull", "min_version", "clock") if k in header} == ask
    run.step()
    later = [(kind, header.get("keys")) for kind, _, header, _ in run.sent[2:]]
    if exchange == "phased":
        assert later == [("wait", None), ("pull", [0, 1, 2])]
    else:
        assert later == []  # the values came back with the pushes


def test_a_parameter_without_a_gradient_holds_the_last_bucket_until_step(runs):
    run = runs(chain(unused=True), PSConfig(**FAST))
    run.backward()
    assert run.pushes() == []  # backward is not known to be done: the bucket waits
    run.step()
    assert [spec.name for spec in run.layout.specs] == ["spare", "0.weight", "2.weight", "4.weight"]
    assert run.pushes() == [("push+pull", 0, [3, 2, 1])]  # step() sends what is left; no key of 'spare'
