"""compress.method on a shard, without sockets: compressed frames checked before a tensor is
built, pushes decompressed and averaged, bad contents refused with the parameters untouched,
and compressed pulls (each update's gradient, with the shard's error feedback) with which a
worker's own optimizer follows the shard's values bit for bit."""

import pytest
import torch

from experiments.compression import CompressConfig
from ps.codec import Codec, Packed, key_name
from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, split_values
from ps.protocol import ProtocolError, decode, encode
from ps.shard import ShardServer

F64 = torch.float64
SPECS = [ParamSpec("w", (40, 30), "float64"), ParamSpec("b", (30,), "float64")]
LAYOUT = build_layout(SPECS, 1, 1 << 20)
KEYS = [k.id for k in LAYOUT.keys]


def compressor(method="topk", **kw):
    return CompressConfig(method=method, **kw).build()[0]


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def make(c, pulls=False, workers=2):
    torch.manual_seed(0)
    init = [torch.randn(s.shape, dtype=F64) for s in SPECS]
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, init, 0), sgd, "sync",
                         workers, PSConfig(), compressor=c, compress_pulls=pulls)
    codec = Codec(c, LAYOUT)
    joined = [decode(frames, LAYOUT, codec=codec) for w in range(workers)
              for _, frames in server.handle(b"w%d" % w, encode({"op": "join", "worker": w, "req": 1}))]
    return server, codec, [torch.cat([t.reshape(-1) for t in m.tensors]) for m in joined]


def packed_push(server, codec, worker, step, grads, **fields):
    parts = [codec.compress(k, grads[k], step, worker) for k in KEYS]
    frames = encode({"op": "push", "worker": worker, "req": 2, "step": step, "version": step, "keys": KEYS,
                     **fields}, parts=[(p.frames, p.meta) for p in parts])
    return [decode(f, LAYOUT, codec=codec) for _, f in server.handle(b"w%d" % worker, frames)]


def grads(seed):
    g = torch.randn(1230, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return {KEYS[0]: g[:1200], KEYS[1]: g[1200:]}


def test_key_names_are_the_parameters_names():
    assert [key_name(LAYOUT, k) for k in KEYS] == ["w", "b"]
    split = build_layout(SPECS, 2, 600)
    assert key_name(split, 0).startswith("w[0:")


def test_compressed_frames_round_trip_and_are_checked_before_use():
    codec = Codec(compressor(ratio=0.1), LAYOUT)
    p = codec.compress(KEYS[0], grads(1)[KEYS[0]], 0, 0)
    frames = encode({"op": "push", "worker": 0, "req": 1, "step": 0, "version": 0, "keys": [KEYS[0]]},
                    parts=[(p.frames, p.meta)])
    msg = decode(frames, LAYOUT, codec=codec)
    assert [tuple(t.shape) for t in msg.parts[0]] == [(120,), (120,)]
    with pytest.raises(ProtocolError, match="runs without compress.method"):
        decode(frames, LAYOUT)
    other = Codec(compressor(ratio=0.2), LAYOUT)  # a peer with another ratio: 240 entries expected
    with pytest.raises(ProtocolError, match=r"key 0: compressed frames .*expected \[\('float64', \[240\]\)"):
        decode(frames, LAYOUT, codec=other)
    rk = Codec(compressor("randomk", ratio=0.1), LAYOUT)
    bad = encode({"op": "push", "worker": 0, "req": 1, "step": 0, "version": 0, "keys": [KEYS[0]]},
                 parts=[((torch.zeros(120, dtype=F64),), (7, 99))])
    with pytest.raises(ProtocolError, match="key 0: randomk: message header"):
        decode(bad, LAYOUT, codec=rk)


def test_shard_averages_decompressed_pushes():
    c = compressor(ratio=0.1)
    server, codec, (start, _) = make(c)
    g0, g1 = grads(1), grads(2)
    assert packed_push(server, codec, 0, 0, g0)[0].op == "ok"
    assert packed_push(server, codec, 1, 0, g1)[0].op == "ok"
    mean = [(codec.decompress(k, *astuple(codec.compress(k, g0[k], 0, 0))) +
             codec.decompress(k, *astuple(codec.compress(k, g1[k], 0, 1)))) / 2 for k in KEYS]
    assert torch.equal(torch.cat([server.chunks[k] for k in KEYS]), start - 0.5 * torch.cat(mean))


def astuple(p: Packed):
    return p.frames, p.meta


def test_bad_compressed_push_is_refused_and_touches_nothing():
    c = compressor(ratio=0.1)
    server, codec, _ = make(c)
    before = {k: t.clone() for k, t in server.chunks.items()}
    p = codec.compress(KEYS[0], grads(1)[KEYS[0]], 0, 0)
    wild = Packed((p.frames[0], torch.full_like(p.frames[1], 5000)), p.meta)  # index past 1200
    q = codec.compress(KEYS[1], grads(1)[KEYS[1]], 0, 0)
    frames = encode({"op": "push", "worker": 0, "req": 2, "step": 0, "version": 0, "keys": KEYS},
                    parts=[astuple(wild), astuple(q)])
    (reply,) = [decode(f) for _, f in server.handle(b"w0", frames)]
    assert reply.op == "error" and "topk: indices must lie in 0..1199" in reply.get("error")
    whole = encode({"op": "push", "worker": 0, "req": 3, "step": 0, "version": 0, "keys": KEYS},
                   [grads(1)[k] for k in KEYS])
    (reply,) = [decode(f) for _, f in server.handle(b"w0", whole)]
    assert reply.op == "error" and "compresses pushes (compress.method=topk)" in reply.get("error")
    assert all(torch.equal(before[k], server.chunks[k]) for k in KEYS)
    assert server.version == 0 and server.counters["pushes"] == 0


@pytest.mark.parametrize("method,kw", [("topk", {"ratio": 0.05}), ("sign", {}), ("qsgd", {"levels": 4}),
                                       ("randomk", {"ratio": 0.05})])
def test_workers_applying_the_pulled_gradients_hold_the_shards_values(method, kw):
    """Each step's reply is the update's compressed gradient; a worker whose own SGD with
    momentum steps on it holds the shard's values bit for bit, and what the messages left
    out waits in the shard's residual rather than being lost."""
    c = compressor(method, **kw)
    server, codec, held = make(c, pulls=True)
    params = [torch.nn.Parameter(h.clone()) for h in held]
    optimizers = [sgd([p]) for p in params]
    for step in range(6):
        for w in (0, 1):
            replies = packed_push(server, codec, w, step, grads(10 * step + w), pull=1, min_version=step + 1)
        assert server.version == step + 1
        assert len(replies) == 2  # worker 1's push completed the step: both push+pulls answered
        for w, reply in zip((1, 0), replies):
            assert reply.get("version") == step + 1
            params[w].grad = torch.cat([codec.decompress(k, p, m) for k, p, m in
                                        zip(reply.keys, reply.parts, reply.get("meta"))])
            optimizers[w].step()
    chunk = torch.cat([server.chunks[k] for k in KEYS])
    assert torch.equal(params[0].detach(), chunk) and torch.equal(params[1].detach(), chunk)
    assert max(r.abs().max() for r in server.pulls.residual.values()) > 0


def test_a_pull_of_another_version_than_the_last_update_is_refused():
    server, codec, _ = make(compressor(ratio=0.05), pulls=True)
    for w in (0, 1):
        packed_push(server, codec, w, 0, grads(w))
    with pytest.raises(RuntimeError, match="a compressed pull of version 2, but its last update made version 1"):
        server.pulls.message(KEYS[0], 2)


def test_whole_compressed_pulls_are_the_averaged_gradient():
    """top-k of every entry: the message is the averaged gradient itself, nothing left out."""
    server, codec, _ = make(compressor(ratio=1.0), pulls=True)
    g = [grads(w) for w in (0, 1)]
    for w in (0, 1):
        replies = packed_push(server, codec, w, 0, g[w], pull=1, min_version=1)
    reply = replies[0]
    got = torch.cat([codec.decompress(k, p, m) for k, p, m in zip(reply.keys, reply.parts, reply.get("meta"))])
    assert torch.equal(got, torch.cat([(g[0][k] + g[1][k]) / 2 for k in KEYS]))
    assert all(r.abs().max() == 0 for r in server.pulls.residual.values())
