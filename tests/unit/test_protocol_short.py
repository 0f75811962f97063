"""ps.protocol_short reads a push+pull's reply as ps.protocol.decode does, or leaves it to
decode: never a message decode refuses, never other values."""

import random

import pytest
import torch

from ps.layout import ParamSpec, build_layout
from ps.protocol import ProtocolError, decode, encode
from ps.protocol_short import WholeKeys, decode_reply

SPECS = [ParamSpec("w", (4, 3), "float32"), ParamSpec("b", (3,), "float64"), ParamSpec("h", (5,), "bfloat16")]
LAYOUT = build_layout(SPECS, 2, 5)
SHARD0 = [k.id for k in LAYOUT.shard_keys(0)]


def reply(keys, **fields):
    tensors = [torch.arange(LAYOUT.keys[k].numel).to(getattr(torch, LAYOUT.key_dtype[k])) for k in keys]
    frames = encode({"op": "ok", "worker": 1, "req": 9, "version": 3, "keys": keys, **fields}, tensors)
    return [bytes(frames[0])] + [memoryview(bytearray(f)) for f in frames[1:]]


def same(a, b):
    return a.header == b.header and len(a.tensors) == len(b.tensors) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))


def test_a_push_pull_reply_reads_as_decode_reads_it():
    whole = WholeKeys(LAYOUT, SHARD0)
    frames = reply(SHARD0, staleness=2, waited_us=5)
    short = decode_reply(frames, whole)
    assert short is not None and same(short, decode(frames, LAYOUT, shard=0))


def mutations(frames):
    import msgpack
    h = msgpack.unpackb(frames[0])
    variants = []
    for field, value in [("op", "error"), ("v", True), ("worker", -1), ("req", 1.0), ("version", 1 << 63),
                         ("keys", [SHARD0[0], SHARD0[0]]), ("keys", [10**6] + h["keys"][1:]),
                         ("keys", [True] + h["keys"][1:]), ("dtypes", ["float64"] * len(h["keys"])),
                         ("shapes", [[1]] * len(h["keys"])), ("shapes", [[float(s[0])] for s in h["shapes"]]),
                         ("body", {}), ("rows", [-1] * len(h["keys"])), ("staleness", "x")]:
        variants.append([msgpack.packb({**h, field: value}), *frames[1:]])
    variants.append([frames[0], *frames[1:-1]])  # a frame missing
    variants.append([frames[0], *frames[1:], memoryview(bytearray(4))])  # a frame too many
    variants.append([frames[0], frames[1][:-1], *frames[2:]])  # a frame short
    variants.append([frames[0], bytes(frames[1]), *frames[2:]])  # a read-only frame: decode's to copy
    variants.append([frames[0] + b"\x00", *frames[1:]])
    variants.append([b"\x93\x01\x02\x03", *frames[1:]])
    return variants


@pytest.mark.parametrize("seed", range(3))
def test_what_the_short_reader_takes_decode_takes_the_same(seed):
    rng = random.Random(seed)
    keys = rng.sample(SHARD0, rng.randint(1, len(SHARD0)))
    whole, taken = WholeKeys(LAYOUT, SHARD0), 0
    for frames in mutations(reply(keys, staleness=0)):
        short = decode_reply(frames, whole)
        if short is None:
            continue
        taken += 1
        try:
            full = decode(frames, LAYOUT, shard=0)
        except ProtocolError as e:
            pytest.fail(f"the short reader took a message decode refuses: {e}")
        assert same(short, full)
    assert taken == 0  # every variant is refused by decode, or (the read-only frame) read by it alone


def test_keys_of_another_shard_are_not_in_its_table():
    frames = reply([k.id for k in LAYOUT.shard_keys(1)])
    assert decode_reply(frames, WholeKeys(LAYOUT, SHARD0)) is None
    with pytest.raises(ProtocolError):
        decode(frames, LAYOUT, shard=0)
