"""Wire protocol (pure): round trips, and every validation error, both from decode() and as
the server's error reply that leaves its parameters bit-for-bit unchanged."""

import random

import msgpack
import pytest
import torch

from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, split_values
from ps.protocol import PROTOCOL_VERSION, Limits, ProtocolError, decode, encode, peek_ids
from ps.shard import ShardServer

SPECS = [ParamSpec("w", (6, 5), "float64"), ParamSpec("b", (5,), "float64"), ParamSpec("h", (4,), "float16")]
LAYOUT = build_layout(SPECS, 2, 8)
SHARD0 = [k.id for k in LAYOUT.shard_keys(0)]
OTHER = next(k for k in LAYOUT.keys if k.shard == 1)


def _grad(k, value=0.5):
    key = LAYOUT.keys[k]
    return torch.full((key.numel,), value, dtype=getattr(torch, LAYOUT.dtype(key)))


def _push(**changes):
    """A valid push to shard 0 as (header, frames), with header fields changed."""
    header = {"op": "push", "v": PROTOCOL_VERSION, "worker": 0, "req": 5, "step": 0, "version": 0,
              "keys": list(SHARD0)}
    tensors = [_grad(k) for k in SHARD0]
    frames = encode(header, tensors)
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return header, [bytes(f) for f in frames[1:]]


def _frames(header=None, tensors=None, **changes):
    h, fr = _push(**changes)
    return [msgpack.packb(h if header is None else header), *(fr if tensors is None else tensors)]


def _set_first(field, value):
    h, fr = _push()
    h[field] = [value, *h[field][1:]]
    return [msgpack.packb(h), *fr]


def _duplicate_key():
    h, fr = _push()
    h.update(keys=[SHARD0[0]] * 2, dtypes=h["dtypes"][:1] * 2, shapes=h["shapes"][:1] * 2)
    return [msgpack.packb(h), fr[0], fr[0]]


def _other_shard_key():
    h, fr = _push()
    h.update(keys=[OTHER.id], dtypes=[LAYOUT.dtype(OTHER)], shapes=[[OTHER.numel]])
    return [msgpack.packb(h), bytes(encode({"keys": [OTHER.id]}, [_grad(OTHER.id)])[1])]


def _extra_frame_pull():
    return [msgpack.packb({"op": "pull", "v": PROTOCOL_VERSION, "worker": 0, "req": 1, "keys": []}), b"x"]


# name -> (frames, substring the error must contain)
BAD = {
    "unknown op": (lambda: _frames(op="frobnicate"), "'op' is 'frobnicate'"),
    "wrong version": (lambda: _frames(v=PROTOCOL_VERSION + 1), "protocol version"),
    "unknown worker": (lambda: _frames(worker=7), "'worker' is 7; not a known worker"),
    "bool worker": (lambda: _frames(worker=True), "'worker' is True"),
    "negative step": (lambda: _frames(step=-1), "'step' is -1"),
    "float version": (lambda: _frames(version=0.0), "'version' is 0.0"),
    "unknown key": (lambda: _set_first("keys", 999), "key 999 is not in the layout"),
    "key of another shard": (_other_shard_key, f"key {OTHER.id} belongs to shard 1"),
    "wrong dtype": (lambda: _set_first("dtypes", "float32"), "dtype 'float32' does not match the layout's 'float64'"),
    "unknown dtype": (lambda: _set_first("dtypes", "int64"), "dtype 'int64' is not one of"),
    "wrong shape": (lambda: _set_first("shapes", [3, 3]), "shape [3, 3] does not match"),
    "frame length mismatch": (lambda: _frames(tensors=[b"\0" * 3] + _push()[1][1:]), "tensor frame is 3 bytes; expected"),
    "frame count mismatch": (lambda: _frames(tensors=_push()[1][:-1]), "tensor frame(s) for"),
    "duplicate key": (_duplicate_key, "twice"),
    "non-dict header": (lambda: [msgpack.packb([1, 2, 3])], "expected a dict"),
    "garbage bytes": (lambda: [b"\xc1\xff\x00 not msgpack"], "not valid msgpack"),
    "truncated msgpack": (lambda: [_frames()[0][:-4], *_frames()[1:]], "not valid msgpack"),
    "oversize header": (lambda: _frames(pad="x" * (2 << 20)), "bytes; at most"),
    "extra field": (lambda: _frames(colour="red"), "['colour'] not allowed"),
    "missing field": (lambda: [msgpack.packb({"op": "push", "v": 1, "worker": 0})], "lacks field(s) ['req']"),
    "missing push field": (lambda: [msgpack.packb({"op": "push", "v": 1, "worker": 0, "req": 1})], "needs header field"),
    "bytes in header": (lambda: _frames(op=b"push"), "not valid msgpack"),
    "int map key": (lambda: [msgpack.packb({1: "x"})], "not valid msgpack"),
    "too many keys": (lambda: _frames(keys=list(range(70_000))), "not valid msgpack"),
    "dtypes without shapes": (lambda: [msgpack.packb({"op": "ok", "v": 1, "worker": 0, "req": 1, "keys": [],
                                                      "dtypes": []})], "together"),
    "extra frame": (_extra_frame_pull, "extra frame"),
    "empty message": (lambda: [], "empty message"),
    "bin map key": (lambda: [msgpack.packb({b"": 1, **_push()[0]}, use_bin_type=True), *_push()[1]], "not allowed"),
    "list as dtype": (lambda: _set_first("dtypes", ["float64"]), "dtype ['float64'] is not one of"),
    "not a buffer": (lambda: ["a str is not a frame"], "byte buffers"),
    "settings not a map": (lambda: [msgpack.packb({"op": "join", "v": 1, "worker": 1, "req": 1, "settings": [1]})],
                           "'settings' is list"),
    "setting of a list": (lambda: [msgpack.packb({"op": "join", "v": 1, "worker": 1, "req": 1,
                                                  "settings": {"seed": [0]}})], "setting 'seed' is a list"),
    "settings on a push": (lambda: _frames(settings={"seed": 0}), "['settings'] not allowed"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_decode_rejects(name):
    build, expected = BAD[name]
    with pytest.raises(ProtocolError) as info:
        decode(build(), LAYOUT, range(2), shard=0)
    assert expected in str(info.value)


def _server():
    init = [torch.randn(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS]
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, init, 0), lambda p: torch.optim.SGD(p, lr=1.0),
                         "async", 2, PSConfig(async_scale="sum"))
    assert decode(server.handle(b"w0", encode({"op": "join", "worker": 0, "req": 1}))[0][1]).op == "ok"
    return server


def _snapshot(server):
    return {k: bytes(t.numpy().tobytes()) for k, t in server.chunks.items()}


@pytest.mark.parametrize("name", list(BAD))
def test_server_replies_error_and_changes_nothing(name):
    server = _server()
    before = _snapshot(server)
    build, expected = BAD[name]
    replies = server.handle(b"w0", build())
    assert len(replies) == 1 and replies[0][0] == b"w0"
    reply = decode(replies[0][1])
    assert reply.op == "error" and expected in reply.get("error") and "shard 0" in reply.get("error")
    assert _snapshot(server) == before
    assert server.stats()["malformed"] == 1 and server.version == 0
    # ...and the shard still works: a good push is applied
    ok = decode(server.handle(b"w0", [bytes(f) for f in encode(*_good())])[0][1])
    assert ok.op == "ok" and _snapshot(server) != before


def _good():
    return {"op": "push", "worker": 0, "req": 9, "step": 0, "version": 0, "keys": SHARD0}, [_grad(k) for k in SHARD0]


def test_error_reply_keeps_request_id_when_readable():
    server = _server()
    reply = decode(server.handle(b"w0", _frames(req=42, op="nope"))[0][1])
    assert (reply.worker, reply.req) == (0, 42)
    assert peek_ids([b"\xc1"]) == (-1, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_round_trip_each_dtype(dtype):
    specs = [ParamSpec("x", (3, 7), str(dtype).removeprefix("torch.")), ParamSpec("empty", (0,), "float32")]
    layout = build_layout(specs, 1, 100)
    x = torch.randn(21).to(dtype)
    frames = encode({"op": "push", "worker": 1, "req": 3, "step": 4, "version": 2, "keys": [0, 1]},
                    [x, torch.empty(0)])
    buffers = [memoryview(bytearray(f)) for f in frames]  # writable, as zmq frames are
    msg = decode(buffers, layout, range(2), shard=0)
    assert (msg.op, msg.worker, msg.req, msg.get("step"), msg.get("version"), msg.keys) == ("push", 1, 3, 4, 2, [0, 1])
    assert msg.tensors[0].dtype == dtype and torch.equal(msg.tensors[0], x) and msg.tensors[1].numel() == 0
    buffers[1][:] = bytes(buffers[1].nbytes)  # built on the frame, not copied
    assert not msg.tensors[0].any()


def test_encode_sends_without_copy_and_checks_tensors():
    x = torch.arange(4.0)
    frame = encode({"op": "ok", "worker": 0, "req": 0, "keys": [0]}, [x])[1]
    x[0] = 9.0
    assert torch.frombuffer(bytearray(frame), dtype=torch.float32)[0] == 9.0
    with pytest.raises(ValueError, match="contiguous"):
        encode({"op": "ok", "worker": 0, "req": 0, "keys": [0]}, [torch.ones(3, 4).t()])
    with pytest.raises(ValueError, match="not supported"):
        encode({"op": "ok", "worker": 0, "req": 0, "keys": [0]}, [torch.ones(3, dtype=torch.int64)])
    with pytest.raises(ValueError, match="2 keys for 1 tensors"):
        encode({"op": "ok", "worker": 0, "req": 0, "keys": [0, 1]}, [x])


def test_limits_bound_tensor_bytes():
    frames = encode({"op": "ok", "worker": 0, "req": 0, "keys": [0]}, [torch.zeros(1000)])
    with pytest.raises(ProtocolError, match="exceeds the limit of 100"):
        decode(frames, None, None, Limits(max_tensor_bytes=100))


@pytest.mark.timeout(30)
def test_fuzzed_messages_only_ever_raise_protocol_error():
    """Random byte flips, truncations and field values: decode raises ProtocolError or
    succeeds; the server never raises and changes values only through valid pushes."""
    rng = random.Random(0)
    server = _server()
    good_header, good_frames = _push()
    packed = msgpack.packb(good_header)
    junk = [None, -1, 2**64 - 1, 1.5, "x", b"", [], {}, [1, [2]], {"a": 1}, True, "float64", [[3]]]
    accepted = 0
    for _ in range(1500):
        if rng.random() < 0.5:
            head = bytearray(packed)
            for _ in range(rng.randint(1, 4)):
                head[rng.randrange(len(head))] = rng.randrange(256)
            head = bytes(head[:rng.randint(0, len(head))] if rng.random() < 0.2 else head)
        else:
            header = dict(good_header)
            header[rng.choice(list(header) + ["extra"])] = rng.choice(junk)
            head = msgpack.packb(header, use_bin_type=True)
        frames = [head, *good_frames[:rng.randint(0, len(good_frames))]]
        try:
            decode(frames, LAYOUT, range(2), shard=0)
            accepted += 1
        except ProtocolError:
            pass
        before = _snapshot(server)
        replies = server.handle(b"w0", frames)
        if decode(replies[0][1]).op == "error":
            assert _snapshot(server) == before
    assert accepted < 1500 and server.stats()["malformed"] > 0


def test_error_replies_carry_a_code_a_client_can_act_on():
    """Kinds of error a client acts on travel as a code (never matched by their text)."""
    from ps.protocol import ERROR_CODES, error_reply

    msg = decode(error_reply(1, 7, "worker 1 has not joined; send join first", "not_joined"))
    assert msg.op == "error" and msg.get("code") == "not_joined" and "not_joined" in ERROR_CODES
    assert decode(error_reply(1, 7, "anything")).get("code") is None
    with pytest.raises(ValueError, match="error code 'oops'"):
        error_reply(1, 7, "x", "oops")
    forged = encode({"op": "error", "worker": 1, "req": 7, "error": "x", "code": "reboot"})
    with pytest.raises(ProtocolError, match="'code' is 'reboot'"):
        decode(forged)



def test_a_shape_equal_to_the_layouts_but_of_floats_is_refused():
    """Whole keys are checked against the layout's tables first, and [8.0] == [8] in Python:
    a shape of floats must still be refused."""
    header, frames = _push()
    header["shapes"] = [[float(d) for d in s] for s in header["shapes"]]
    with pytest.raises(ProtocolError, match="must be a list of ints"):
        decode([msgpack.packb(header), *frames], LAYOUT, shard=0)
