"""Malformed traffic over the network: a live sync shard on tcp://127.0.0.1 takes over 10,000
hostile messages from several DEALER sockets, answers each with an error (or, above
max_message_mb, never sees it: the socket drops the connection), changes nothing, and then
trains two real workers exactly. About 8 s on 2 cores.

test_ps_protocol.py fuzzes decode() and ShardServer.handle() in process; this goes through
the sockets, framing and serve loop. The generator is seeded; a decoder run here (the
"oracle") checks what each message is before it is sent.
"""

import collections
import random
import re
import time

import msgpack
import pytest
import torch

from ps.config import PSConfig
from ps.layout import TORCH_DTYPES, ParamSpec, build_layout, join_values, split_values
from ps.local import LocalCluster
from ps.protocol import BASE_FIELDS, OP_FIELDS, PROTOCOL_VERSION, Limits, ProtocolError, decode, encode
from ps.protocol_state import state_fields
from ps.transport import ClientTransport

SPECS = [ParamSpec("w", (12, 20), "float32"), ParamSpec("b", (20,), "float32"),
         ParamSpec("d", (6, 5), "float64"), ParamSpec("e", (7,), "float64")]
LAYOUT = build_layout(SPECS, 2, 64)  # w is cut into 4 chunks of 60 over both shards
KEYS0 = [k.id for k in LAYOUT.shard_keys(0)]
OTHER = [k.id for k in LAYOUT.shard_keys(1)]
CONFIG = PSConfig(max_message_mb=1.0, timeout_s=120.0, heartbeat_s=0.05, worker_timeout_s=60.0)
LIMITS = Limits(max_tensor_bytes=CONFIG.max_message_bytes)  # as the shard decodes
WORKERS = 2
SOCKETS = 4
BATCH = 64  # messages in flight per socket before its replies are read
REPLY_WAIT_S = 10.0
REQUESTS = ("push", "pull", "wait", "heartbeat", "stats", "checkpoint", "leave", "shutdown", "state", "load")


def init_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s.shape, generator=gen).to(TORCH_DTYPES[s.dtype]) for s in SPECS]


def request(rng, op, worker=None, keys=None, step=0, version=0):
    """A valid request to shard 0 as (header dict, tensor frames as bytes)."""
    header = {"op": op, "v": PROTOCOL_VERSION, "worker": rng.randrange(WORKERS) if worker is None else worker,
              "req": rng.randrange(1 << 30)}
    tensors = None
    if op == "push":
        keys = keys or rng.sample(KEYS0, rng.randint(1, len(KEYS0)))
        header.update(step=step, version=version, keys=keys)
        tensors = [torch.full((LAYOUT.keys[k].numel,), 0.5, dtype=TORCH_DTYPES[LAYOUT.dtype(k)]) for k in keys]
    elif op == "pull":
        header["keys"] = rng.sample(KEYS0, rng.randint(0, len(KEYS0)))
    elif op == "wait":
        header["min_version"] = 0  # answered at once: nothing here completes a step
    elif op == "state":
        header["keys"] = rng.sample(KEYS0, rng.randint(0, len(KEYS0)))
    elif op == "load":  # Adam's state of every key of the shard
        fields, tensors = state_fields([[("exp_avg", torch.full((LAYOUT.keys[k].numel,), 0.5,
                                                                dtype=TORCH_DTYPES[LAYOUT.dtype(k)])),
                                         ("step", torch.tensor(1.0))] for k in KEYS0])
        header.update(keys=KEYS0, **fields)
    frames = encode(header, tensors)
    return msgpack.unpackb(frames[0]), [bytes(f) for f in frames[1:]]


def pack(header, tensors=()):
    return [msgpack.packb(header, use_bin_type=True), *tensors]


def push(rng, **kw):
    return request(rng, "push", **kw)


# -- categories: rng -> (frames, expected outcome, regex the error text must match) -------------
# expected: "malformed" (decode fails), "rejected" (well-formed, refused: nobody has joined), or
# "oracle" (random: whatever the decoder says).

def random_single(rng):
    return [rng.randbytes(rng.randint(0, 300))], "malformed", None


def random_multi(rng):
    return [rng.randbytes(rng.randint(0, 120)) for _ in range(rng.randint(2, 8))], "malformed", None


def truncated_header(rng):
    h, t = push(rng)
    head = pack(h)[0]
    return [head[:rng.randrange(len(head))], *t], "malformed", "msgpack"


def corrupted_header(rng):
    h, t = request(rng, rng.choice(REQUESTS))
    head = bytearray(pack(h)[0])
    for _ in range(rng.randint(1, 4)):
        head[rng.randrange(len(head))] = rng.randrange(256)
    return [bytes(head), *t], "oracle", None


def garbage_values(rng):
    h, t = push(rng)  # NaNs, infinities: well-formed, and refused before anything is read
    return pack(h, [rng.randbytes(len(x)) for x in t]), "rejected", "has not joined"


def wrong_op(rng):
    h, t = push(rng)
    h["op"] = rng.choice(["pushh", "", "PUSH", "get", "delete", None, 1, -1, 3.5, True, ["push"],
                          {"op": "push"}, "push\x00", "x" * 1000, "join "])
    return pack(h, t), "malformed", "'op'"


def reply_as_request(rng):
    h = {"op": "ok", "v": PROTOCOL_VERSION, "worker": rng.randrange(WORKERS), "req": rng.randrange(100)}
    if rng.random() < 0.5:
        h.update(op="error", error="forged", worker=rng.choice([-1, 0, 1]))
    return pack(h), "rejected", "expected a request"


def wrong_version(rng):
    h, t = request(rng, rng.choice(REQUESTS))
    h["v"] = rng.choice([0, 2, -1, 999, "1", 1.0, True, None, 2**40, [1]])
    return pack(h, t), "malformed", "protocol version"


def unknown_key(rng):
    h, t = push(rng)
    i = rng.randrange(len(h["keys"]))
    h["keys"][i] = rng.choice([len(LAYOUT.keys), len(LAYOUT.keys) + 7, -1, -2**40, 2**62, 2**63, "0", 1.5,
                               None, [0]])
    return pack(h, t), "malformed", "key"


def other_shard_key(rng):
    keys = rng.sample(KEYS0, rng.randint(0, len(KEYS0) - 1))
    keys.insert(rng.randint(0, len(keys)), rng.choice(OTHER))
    h, t = push(rng, keys=keys)
    return pack(h, t), "malformed", "belongs to shard 1"


def wrong_dtype(rng):
    h, t = push(rng)
    i = rng.randrange(len(h["keys"]))
    right = h["dtypes"][i]
    h["dtypes"][i] = rng.choice([d for d in ("float32", "float64", "float16", "bfloat16", "int8", "float", "",
                                             None, 4, ["float32"]) if d != right])
    return pack(h, t), "malformed", "dtype"


def wrong_shape(rng):
    h, t = push(rng)
    i = rng.randrange(len(h["keys"]))
    n = h["shapes"][i][0]
    h["shapes"][i] = rng.choice([[n + 1], [n - 1], [n, 1], [1, n], [], [0], [-1], "n", [n, "x"], None, [n * 2]])
    return pack(h, t), "malformed", "shape"


def size_beyond_frame(rng):
    h, t = push(rng)
    i = rng.randrange(len(t))
    if rng.random() < 0.5:  # declared right, frame cut short or padded
        t[i] = t[i][:rng.randrange(len(t[i]))] if rng.random() < 0.5 else t[i] + rng.randbytes(rng.randint(1, 64))
        return pack(h, t), "malformed", "tensor frame is"
    h["shapes"][i] = rng.choice([[2**40], [2**31, 2**31], [2**62 - 1], [1 << 20, 1 << 20, 1 << 20]])
    return pack(h, t), "malformed", "shape"


def frame_count(rng):
    h, t = push(rng)
    kind = rng.randrange(4)
    if kind == 0:
        return pack(h, t[:-1]), "malformed", "frame"
    if kind == 1:
        return pack(h, t + [rng.randbytes(8)] * rng.randint(1, 3)), "malformed", "frame"
    op = rng.choice(["pull", "heartbeat", "stats", "join"])
    h, _ = request(rng, op)
    return pack(h, [b"\x00" * rng.randint(0, 16)] * rng.randint(1, 3)), "malformed", "extra frame"


def many_frames(rng):
    h, _ = push(rng, keys=[KEYS0[0]])
    if rng.random() < 0.5:  # declares many keys too
        h.update(keys=list(range(10_000)), dtypes=["float32"] * 10_000, shapes=[[1]] * 10_000)
    return pack(h, [b"\x00\x00\x00\x00"] * 10_000), "malformed", "frame|key"


def extra_fields(rng):
    op = rng.choice(REQUESTS)
    h, t = request(rng, op)
    allowed = set(BASE_FIELDS).union(*OP_FIELDS[op])
    name = rng.choice([f for f in ("x", "evil", "__class__", "min_version", "clock", "body", "error", "staleness",
                                   "", "layout") if f not in allowed])
    h[name] = rng.choice([1, "x", None, [1, 2], {"a": 1}])
    return pack(h, t), "malformed", "not allowed"


def missing_fields(rng):
    h, t = push(rng)
    del h[rng.choice(["op", "v", "worker", "req", "step", "version", "keys", "dtypes", "shapes"])]
    return pack(h, t), "malformed", "lacks field|needs header field"


def wrong_types(rng):
    kind = rng.randrange(3)
    if kind == 0:  # not a map at all
        return [msgpack.packb(rng.choice([[1, 2], 5, "push", None, True, 1.5, [{"op": "push"}]]))], "malformed", None
    if kind == 1:  # bytes or int map keys: refused by the msgpack limits
        h, t = push(rng)
        h[rng.choice([b"op", 1, 2.5])] = "push"
        return pack(h, t), "malformed", "msgpack"
    h, t = request(rng, rng.choice(REQUESTS))
    name = rng.choice([f for f in h if f != "op"])
    h[name] = rng.choice(["0", -1, 2**62, 1.5, None, {"k": 1}, [[0]], b"\x00", "float32"])
    return pack(h, t), "oracle", None


def unknown_worker(rng):
    h, t = request(rng, rng.choice(REQUESTS + ("join",)))
    h["worker"] = rng.choice([2, 3, 17, 1000, 2**31, 2**62 - 1, 2**62, 2**63 - 1, 2**64 - 1, -1, -2, -2**31, -2**63])
    return pack(h, t), "malformed", "worker"


def not_joined(rng):
    h, t = request(rng, rng.choice(REQUESTS))
    return pack(h, t), "rejected", "has not joined"


def parts_over_total(rng):
    """Every part under max_message_mb, the whole above it: past the socket, refused by decode."""
    h, _ = push(rng, keys=KEYS0[:2])
    part = b"\x00" * (CONFIG.max_message_bytes * 3 // 4)
    return pack(h, [part, part]), "malformed", "tensor frame is"


CATEGORIES = {  # name -> (generator, count)
    "random_single": (random_single, 1500),
    "random_multi": (random_multi, 800),
    "truncated_header": (truncated_header, 700),
    "corrupted_header": (corrupted_header, 1500),
    "garbage_values": (garbage_values, 300),
    "wrong_op": (wrong_op, 400),
    "reply_as_request": (reply_as_request, 200),
    "wrong_version": (wrong_version, 400),
    "unknown_key": (unknown_key, 400),
    "other_shard_key": (other_shard_key, 300),
    "wrong_dtype": (wrong_dtype, 400),
    "wrong_shape": (wrong_shape, 400),
    "size_beyond_frame": (size_beyond_frame, 400),
    "frame_count": (frame_count, 400),
    "many_frames": (many_frames, 6),
    "extra_fields": (extra_fields, 400),
    "missing_fields": (missing_fields, 400),
    "wrong_types": (wrong_types, 600),
    "unknown_worker": (unknown_worker, 500),
    "not_joined": (not_joined, 400),
    "parts_over_total": (parts_over_total, 4),
}
OVERSIZED = 12


def oracle(frames):
    """What the shard will make of frames before anyone has joined: "malformed", "rejected",
    or "join" (a valid join: it would change the shard's state, so it is not sent)."""
    try:
        msg = decode(frames, LAYOUT, range(WORKERS), LIMITS, shard=0)
    except ProtocolError:
        return "malformed"
    return "join" if msg.op == "join" else "rejected"


def schedule(rng):
    """Every message to send: (category, frames, expected, pattern), shuffled."""
    out = []
    for name, (make, count) in CATEGORIES.items():
        made = 0
        while made < count:
            frames, expected, pattern = make(rng)
            seen = oracle(frames)
            if seen == "join":
                continue
            assert expected in ("oracle", seen), (name, expected, seen, frames[0][:200])
            out.append((name, frames, seen, pattern))
            made += 1
    rng.shuffle(out)
    return out


class Socket:
    """A fuzzing DEALER, with the expectations of its messages still awaiting replies."""

    def __init__(self, address):
        self.t = ClientTransport(address, None, send_timeout_s=5.0)
        self.waiting = collections.deque()

    def send(self, item, counts):
        self.t.send(item[1])  # a full queue raises TransportError after 5 s instead of hanging
        self.waiting.append(item)
        counts[item[0]] += 1

    def drain(self, outcomes):
        """Read one reply per message sent; replies come back in the order sent."""
        while self.waiting:
            name, _, expected, pattern = self.waiting.popleft()
            reply = decode(self.t.recv(REPLY_WAIT_S, f"the reply to a {name} message"))
            text = reply.get("error") or ""
            assert reply.op == "error" and text.startswith("shard 0: "), (name, reply.header)
            assert pattern is None or re.search(pattern, text), (name, pattern, text)
            outcomes[expected] += 1


def wait_until(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def snapshot(values):
    return {k: t.numpy().tobytes() for k, t in values.items()}


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_live_shard_survives_malformed_traffic_then_trains_exactly():
    rng = random.Random(20240601)
    init = init_params()
    assert {LAYOUT.dtype(k) for k in KEYS0} == {"float32", "float64"}
    assert len(LAYOUT.param_keys(0)) == 4 and any(LAYOUT.keys[k].param == 0 for k in KEYS0)
    messages = schedule(rng)
    counts, outcomes = collections.Counter(), collections.Counter()
    start = time.monotonic()
    with LocalCluster(LAYOUT, init, lambda p: torch.optim.SGD(p, lr=0.5), "sync", WORKERS, CONFIG,
                      address="tcp") as cluster:
        server, transport, address = cluster.servers[0], cluster.transports[0], cluster.addresses[0]

        # 1. hostile messages from several peers at once, replies drained batch by batch
        sockets = [Socket(address) for _ in range(SOCKETS)]
        try:
            for i in range(0, len(messages), BATCH * SOCKETS):
                chunk = messages[i:i + BATCH * SOCKETS]
                for j, item in enumerate(chunk):
                    sockets[j % SOCKETS].send(item, counts)
                for s in sockets:
                    s.drain(outcomes)
        finally:
            closed_from = transport.events["disconnects"]
            for s in sockets:
                s.t.close()
        handled = dict(server.counters)
        sent_bytes = sum(len(f) for _, frames, _, _ in messages for f in frames)
        assert handled["malformed"] == outcomes["malformed"] and handled["rejected"] == outcomes["rejected"]
        assert handled["bytes_in"] == sent_bytes
        assert handled["pushes"] == handled["updates"] == handled["joins"] == 0 and server.version == 0

        # 2. message parts above max_message_mb: the socket drops the connection, the shard never
        #    sees them (no counter moves, no reply)
        wait_until(lambda: transport.events["disconnects"] >= closed_from + SOCKETS)  # phase 1's closes
        dropped_from = transport.events["disconnects"]
        for n in range(OVERSIZED):
            big = rng.randbytes(CONFIG.max_message_bytes + 1 + rng.randrange(1 << 19))
            h, t = push(rng)
            frames = [big] if n % 3 == 0 else pack(h, [big]) if n % 3 == 1 else pack(h, t[:-1] + [big])
            before = transport.events["disconnects"]
            s = ClientTransport(address, None, send_timeout_s=5.0)
            try:
                s.send(frames)
                assert wait_until(lambda: transport.events["disconnects"] > before), "the socket should drop it"
                assert not s.readable(0.02)
            finally:
                s.close()
            counts["oversized"] += 1
        time.sleep(0.2)  # anything that got through would be handled by now
        assert transport.events["disconnects"] - dropped_from >= OVERSIZED
        assert server.counters == handled

        elapsed = time.monotonic() - start
        total = sum(counts.values())
        print(f"\nfuzz: {total} messages in {elapsed:.1f} s; replies {dict(outcomes)}; "
              f"refused by the socket {counts['oversized']}; transport events {transport.events}")
        for name, n in sorted(counts.items()):
            print(f"  {name:18s} {n}")
        assert total >= 10_000 and counts["oversized"] == OVERSIZED
        assert all(counts[name] == n for name, (_, n) in CATEGORIES.items())
        # every message past the socket was counted: malformed, or (well-formed but from a
        # worker that has not joined, or a reply posing as a request) rejected
        assert handled["malformed"] + handled["rejected"] == total - counts["oversized"]
        assert handled["malformed"] >= total - counts["oversized"] - sum(
            CATEGORIES[name][1] for name in ("garbage_values", "reply_as_request", "not_joined", "wrong_types",
                                             "corrupted_header"))

        # 3. the shard still answers, over the network, with its parameters bit for bit
        with cluster.client(0, timeout_s=10.0) as c0, cluster.client(1, timeout_s=10.0) as c1:
            _, version, values = c0.join()
            assert version == 0 and snapshot(values) == snapshot(split_values(LAYOUT, init))
            stats = c0.stats()[0]
            assert (stats["malformed"], stats["rejected"], stats["version"]) == (
                handled["malformed"], handled["rejected"], 0)
            versions, checkpoint = c0.checkpoint()
            assert versions == {0: 0, 1: 0} and snapshot(checkpoint) == snapshot(values)

            # 4. two real workers train; a fuzzer impersonating them pushes bad and stale steps
            c1.join()
            impostor = Socket(address)
            local = [p.clone() for p in init]
            steps, forged = 5, collections.Counter()
            try:
                for step in range(steps):
                    grads = [[torch.full(s.shape, 0.25 * (w + 1) + 0.125 * step, dtype=TORCH_DTYPES[s.dtype])
                              for s in SPECS] for w in range(WORKERS)]
                    handles = [c.push(step, step, split_values(LAYOUT, g)) for c, g in zip((c0, c1), grads)]
                    for _ in range(20):
                        item = forged_push(rng, step)
                        impostor.send(item, forged)
                    for c, h in zip((c0, c1), handles):
                        c.wait(h)
                    pulls = [c.wait(c.pull(min_version=step + 1)) for c in (c0, c1)]
                    impostor.drain(outcomes)
                    for p, g0, g1 in zip(local, *grads):
                        p.sub_(0.5 * (g0 + g1) / 2)
                    for result in pulls:
                        assert result.version == step + 1
                        assert all(torch.equal(a, b) for a, b in zip(join_values(LAYOUT, result.values), local))
            finally:
                impostor.t.close()
            after = c0.stats()
            assert [s["updates"] for s in after] == [steps, steps] and [s["version"] for s in after] == [steps] * 2
            for outcome in ("malformed", "rejected"):
                assert after[0][outcome] == handled[outcome] + sum(n for name, n in forged.items()
                                                                   if name.endswith(outcome))
            assert after[1]["malformed"] == after[1]["rejected"] == 0
            print(f"training: {steps} exact sync steps with {sum(forged.values())} forged messages "
                  f"interleaved {dict(forged)}")
            c0.leave()
            c1.leave()
        assert cluster.join(5.0) and cluster.results == {0: "finished", 1: "finished"}


def forged_push(rng, step):
    """A push in a joined worker's name that the shard must refuse: (name, frames, class, pattern)."""
    # The shard is at version step or step + 1 meanwhile: step + 2 is refused either way.
    kind = rng.randrange(4)
    if kind == 0:
        h, t = push(rng, step=step + rng.randint(2, 4), version=0)
        return "future_step_rejected", pack(h, t), "rejected", "sync push for step"
    if kind == 1:
        h, t = push(rng, step=step, version=step + rng.randint(2, 4))
        return "future_version_rejected", pack(h, t), "rejected", "computed on version"
    if kind == 2:
        h, t = push(rng, step=step, version=step)
        h["shapes"][0] = [h["shapes"][0][0] + 1]
        return "bad_shape_malformed", pack(h, t), "malformed", "shape"
    h, t = push(rng, keys=[KEYS0[0]], step=step, version=step)
    h.update(keys=h["keys"] * 2, dtypes=h["dtypes"] * 2, shapes=h["shapes"] * 2)
    return "duplicate_key_malformed", pack(h, t * 2), "malformed", "twice"
