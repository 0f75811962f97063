"""The shard's short path for a push+pull (ps.shard.fastpath) against its general path: the
same messages, good and bad, given to two shards, one of which may take the short path,
leave the same replies byte for byte, the same parameters in float64 and the same counters;
and the short path does take the messages it is for."""

import gc
import random
import weakref

import msgpack

import pytest
import torch

from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, split_values
from ps.protocol import decode, encode
from ps.shard import ShardServer, compiled

SPECS = [ParamSpec("w", (4, 3), "float64"), ParamSpec("b", (3,), "float64"), ParamSpec("e", (6,), "float64")]
LAYOUT = build_layout(SPECS, 2, 5)  # keys on two shards; shard 0 is tested
MINE = [k.id for k in LAYOUT.shard_keys(0)]
OTHER = [k.id for k in LAYOUT.shard_keys(1)]


class Clock:
    def __init__(self):
        self.now = 10.0

    def __call__(self):
        return self.now


def shard(mode, workers, optimizer, short, compiled_path=True):
    """A shard whose handle either may take the short paths (short; with compiled_path, the
    compiled one first where it is built) or never does; and the list of, per message, whether
    a short path took it."""
    torch.manual_seed(0)
    init = [torch.randn(s.shape, dtype=torch.float64) for s in SPECS]
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, init, 0), optimizer, mode, workers,
                         PSConfig(staleness=1), clock=Clock())
    taken = []
    if not compiled_path:
        server._short.compiled = None
    if short:
        path = server._short

        def counted(peer, frames):
            replies = path(peer, frames)
            taken.append(replies is not None)
            return replies
        counted.compiled = path.compiled
        server._short = counted
    else:
        server._short = lambda peer, frames: None
    return server, taken


def both_ways(a, b):
    """A function giving one message to shard a and a copy to shard b, checking that both reply
    alike, byte for byte; a's replies."""
    def both(peer, frames):
        copy = [f if isinstance(f, bytes) else memoryview(bytearray(f)) for f in frames]
        ra, rb = a.handle(peer, frames), b.handle(peer, copy)
        assert [(p, [bytes(f) for f in fs]) for p, fs in ra] == [(p, [bytes(f) for f in fs]) for p, fs in rb]
        return ra
    return both


def frames_of(header, tensors):
    """A message as the transport hands it over: the header as bytes, tensors as writable views."""
    frames = encode(header, tensors)
    return [bytes(frames[0])] + [memoryview(bytearray(f)) for f in frames[1:]]


def bad(rng, header, tensors):
    """One way or another, a push+pull the protocol or the shard refuses (or reads the long way)."""
    h, t = dict(header), list(tensors)
    kind = rng.randrange(15)
    if kind == 0:
        h["version"] = h["version"] + 5  # a version the shard has not reached
    elif kind == 1:
        h["pull"] = True
    elif kind == 2:
        h["step"] = float(h["step"])
    elif kind == 3:
        h["worker"] = 7  # not a worker of this run
    elif kind == 4:
        h["extra"] = 1
    elif kind == 5:
        del h["version"]
    elif kind == 6:
        h["keys"] = [OTHER[0]] + h["keys"][1:]  # another shard's key
    elif kind == 7:
        h["keys"] = [h["keys"][0]] * len(h["keys"])  # a key twice (or once, when alone)
    elif kind == 8:
        t[0] = t[0][:-1]  # a frame one value short
    elif kind == 9:
        t[0] = t[0].float()  # another dtype
    elif kind == 10:
        h["lr"] = -1.0
    elif kind == 11:
        h["lr"] = 0.25  # a learning rate of its own (sync: unlike the step's)
    elif kind == 12:
        h["v"] = 2
    elif kind == 13:
        h[rng.choice(["worker", "req", "step", "version"])] = None  # nil where an int must be
    else:
        h["clock"] = -1
    frames = encode({k: v for k, v in h.items() if k not in ("dtypes", "shapes")}, t) if kind not in (8, 9) else \
        encode(h, t)
    out = [bytes(frames[0])] + [memoryview(bytearray(f)) for f in frames[1:]]
    if kind == 9:
        out = [bytes(frames[0])] + [bytes(f) for f in frames[1:]]  # read-only: read the long way, still good
    return out


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd-decay": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01, maximize=True),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("path", ["python", "compiled"])
def test_short_and_general_paths_leave_the_same_bytes_and_parameters(mode, optimizer, path):
    """path: Python's short path alone, or the compiled one before it (ps.shard.compiled),
    which takes the push+pulls of every rule under SGD (with momentum: once a key's buffer
    is made)."""
    if path == "compiled" and not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    rng = random.Random(f"{mode}-{optimizer}")
    workers = 3
    a, taken = shard(mode, workers, OPTIMIZERS[optimizer], short=True, compiled_path=path == "compiled")
    b, _ = shard(mode, workers, OPTIMIZERS[optimizer], short=False)
    req = 0

    both = both_ways(a, b)

    for w in range(workers):
        both(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))
    clocks = [0] * workers
    for step in range(6):
        order = list(range(workers))
        rng.shuffle(order)
        for w in order:
            keys = MINE[:]
            rng.shuffle(keys)
            for part in (keys[:1], keys[1:]):  # a step's keys in two messages, in some order
                req += 1
                grads = [torch.randn(LAYOUT.keys[k].numel, dtype=torch.float64) for k in part]
                header = {"op": "push", "worker": w, "req": req, "step": step if mode == "sync" else clocks[w],
                          "version": a.version if mode != "sync" else step, "keys": part, "pull": 1}
                if mode == "sync":
                    header["min_version"] = step + 1
                else:
                    header["clock"] = clocks[w] + 1
                if rng.random() < 0.2:
                    header["lr"] = 0.05
                if rng.random() < 0.3:
                    both(f"w{w}".encode(), bad(rng, header, grads))
                    req += 1
                    header["req"] = req
                if mode == "sync" and rng.random() < 0.2:  # requests of the general path waiting beside the pulls
                    other = rng.choice([{"op": "pull", "keys": part, "min_version": step + 1},
                                        {"op": "wait", "min_version": step + 1}])
                    both(f"w{w}".encode(), encode({**other, "worker": w, "req": req}))
                    req += 1
                    header["req"] = req
                both(f"w{w}".encode(), frames_of(header, grads))
                same_rule(a, b)
                if rng.random() < 0.1:  # the same push again: refused
                    req += 1
                    both(f"w{w}".encode(), frames_of({**header, "req": req}, grads))
            clocks[w] += 1
        a.clock.now += 0.01
        b.clock.now += 0.01
        both(b"w0", frames_of({"op": "heartbeat", "worker": 0, "req": req + 1}, None))
    for k in MINE:
        assert torch.equal(a.chunks[k], b.chunks[k]), k
    assert a.stats() == b.stats()
    assert a.version == b.version > 0
    assert any(taken) and not all(taken)  # the short path took some, the general one the rest
    took = a._short.compiled.taken if a._short.compiled is not None else 0
    assert took > 0 if path == "compiled" and optimizer != "adam" else took == 0
    if took and mode == "sync":  # and answered pulls that waited for the step's last push
        assert a._short.compiled.released > 0


def same_rule(a, b):
    """Under sync, the two shards' step in progress alike: the gradients summed so far, bit for
    bit, who pushed what, the keys updated, the step's learning rate."""
    ra, rb = a.rule, b.rule
    if ra.name != "sync":
        return
    assert (ra.summing, ra.most_summing, ra._step_lr, ra._step_hold, ra._pushed, ra._updated, ra.readied) == \
        (rb.summing, rb.most_summing, rb._step_lr, rb._step_hold, rb._pushed, rb._updated, rb.readied)
    assert ra._sum.keys() == rb._sum.keys()
    for k in ra._sum:
        assert torch.equal(ra._sum[k], rb._sum[k]), k


def test_short_path_takes_a_push_pull_and_its_reply_decodes():
    server, taken = shard("async", 1, OPTIMIZERS["sgd"], short=True)
    server.handle(b"w0", encode({"op": "join", "worker": 0, "req": 0}))
    grads = [torch.ones(LAYOUT.keys[k].numel, dtype=torch.float64) for k in MINE]
    before = {k: server.chunks[k].clone() for k in MINE}
    (peer, frames), = server.handle(b"w0", frames_of({"op": "push", "worker": 0, "req": 1, "step": 0, "version": 0,
                                                      "keys": MINE, "pull": 1, "clock": 1}, grads))
    assert taken == [False, True] and peer == b"w0"  # the join, then the push+pull
    reply = decode(frames, LAYOUT, shard=0)
    assert reply.op == "ok" and reply.keys == MINE and reply.get("staleness") == 0
    for k, t in zip(MINE, reply.tensors):
        assert torch.equal(t, before[k] - 0.1)


@pytest.mark.parametrize("held", ["frames", "a view made from them", "a tensor read from them"])
def test_a_short_reply_still_held_keeps_its_values_and_one_let_go_costs_no_copy(held):
    """The short path's replies are views of the chunks (SnapshotPool.reply_bytes): while one
    is held, however it is held, the next update moves the chunk instead of writing under it;
    once nothing holds one, updates write the chunk where it is."""
    server, taken = shard("async", 1, OPTIMIZERS["sgd"], short=True)
    server.handle(b"w0", encode({"op": "join", "worker": 0, "req": 0}))
    k = MINE[0]
    ones = [torch.ones(LAYOUT.keys[k].numel, dtype=torch.float64)]

    def push_pull(req):
        (_, frames), = server.handle(b"w0", frames_of({"op": "push", "worker": 0, "req": req, "step": req - 1,
                                                      "version": server.version, "keys": [k], "pull": 1,
                                                      "clock": req}, ones))
        return frames

    start = server.chunks[k].clone()
    frames = push_pull(1)
    kept = {"frames": frames, "a view made from them": memoryview(frames[1])[8:],
            "a tensor read from them": decode(frames, LAYOUT, shard=0).tensors[0]}[held]
    first = torch.frombuffer(bytearray(frames[1]), dtype=torch.float64)
    del frames
    newer = decode(push_pull(2), LAYOUT, shard=0).tensors[0].clone()
    now = {"frames": lambda: bytes(kept[1]), "a view made from them": lambda: bytes(kept),
           "a tensor read from them": lambda: kept.numpy().tobytes()}[held]()
    assert now == first.numpy().tobytes()[8 if held == "a view made from them" else 0:]
    assert torch.equal(first, start.reshape(-1) - 0.1) and torch.equal(newer, start.reshape(-1) - 0.1 - 0.1)
    del kept, now
    where = server.chunks[k].data_ptr()
    for req in (3, 4, 5):
        push_pull(req)
    assert server.chunks[k].data_ptr() == where  # nothing held: written in place
    assert torch.equal(server.chunks[k].reshape(-1), newer - 0.1 - 0.1 - 0.1) and all(taken[1:])


def mangled(rng, header_bytes):
    """header_bytes with a byte changed, dropped or added, or cut short."""
    b = bytearray(header_bytes)
    i = rng.randrange(len(b))
    kind = rng.randrange(4)
    if kind == 0:
        b[i] = rng.randrange(256)
    elif kind == 1:
        del b[i]
    elif kind == 2:
        b.insert(i, rng.randrange(256))
    else:
        del b[i:]
    return bytes(b)


@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_compiled_path_reads_mangled_headers_as_the_general_path(mode):
    """Push+pulls whose header has a byte changed, dropped or added (or a float32 lr, or ints
    of every width as the requests grow): a shard whose compiled path may take them answers
    each as a shard that reads every message the general way, byte for byte, and ends with the
    same parameters and counters."""
    if not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    rng = random.Random(mode)
    a, _ = shard(mode, 2, OPTIMIZERS["sgd-decay"], short=True)
    b, _ = shard(mode, 2, OPTIMIZERS["sgd-decay"], short=False)

    both = both_ways(a, b)

    for w in range(2):
        both(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))
    for req in range(1, 700):
        clocks = a.workers.clocks
        w = rng.randrange(2) if clocks[0] == clocks[1] or rng.random() < 0.1 else min(clocks, key=clocks.get)
        keys = rng.sample(MINE, rng.randrange(1, len(MINE) + 1))
        step = a.workers.clocks[w]
        header = {"op": "push", "worker": w, "req": req, "step": step, "version": a.version, "keys": keys, "pull": 1,
                  **({"min_version": step + 1} if mode == "sync" else {"clock": step + 1})}
        if rng.random() < 0.3:
            header["lr"] = rng.choice([0.05, 0.3, 1e-3])
        grads = [torch.randn(LAYOUT.keys[k].numel, dtype=torch.float64) for k in keys]
        frames = frames_of(header, grads)
        if rng.random() < 0.3:
            frames[0] = msgpack.packb(msgpack.unpackb(frames[0]), use_single_float=True)
        if rng.random() < 0.6:
            frames[0] = mangled(rng, frames[0])
        both(f"w{w}".encode(), frames)
        same_rule(a, b)
    for k in MINE:
        assert torch.equal(a.chunks[k], b.chunks[k]), k
    assert a.stats() == b.stats() and a.version == b.version > (10 if mode == "sync" else 20)  # sync: steps of both
    assert a._short.compiled.taken > 20


def test_compiled_path_moves_a_key_that_another_reply_still_points_at():
    """A pull's reply (the general path's) points into its keys' memory; while it is held, a
    push+pull of those keys is not written under it: the compiled path first moves the chunk
    to a copy, as the Python paths do (SnapshotPool.own, counted in moved_keys), and the reply
    keeps the former memory and bytes."""
    if not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    server, taken = shard("async", 1, OPTIMIZERS["sgd"], short=True)
    server.handle(b"w0", encode({"op": "join", "worker": 0, "req": 0}))
    k, ones = MINE[0], [torch.ones(LAYOUT.keys[MINE[0]].numel, dtype=torch.float64)]

    def push_pull(req):
        (_, frames), = server.handle(b"w0", frames_of({"op": "push", "worker": 0, "req": req, "step": req - 1,
                                                      "version": server.version, "keys": [k], "pull": 1,
                                                      "clock": req}, ones))
        return frames

    first = push_pull(1)  # the join's reply lent the key: moved (its frames are gone, nothing holds the memory)
    assert server._short.compiled.taken == 1 and server.counters["moved_keys"] == 0
    del first
    push_pull(2)
    assert server._short.compiled.taken == 2 and server.counters["moved_keys"] == 0
    (_, held), = server.handle(b"w0", encode({"op": "pull", "worker": 0, "req": 3, "keys": [k]}))
    before = bytes(held[1])
    after = bytes(push_pull(4)[1])  # the chunk moves, the pull's reply keeps the former memory
    assert bytes(held[1]) == before != after and server._short.compiled.taken == 3
    assert server.counters["moved_keys"] == 1
    kept = push_pull(5)  # nothing points at the chunk's new memory but this reply's own frames
    assert bytes(held[1]) == before and server._short.compiled.taken == 4 and server.counters["moved_keys"] == 1
    push_pull(6)  # kept still points at it: moved again
    assert server.counters["moved_keys"] == 2 and bytes(kept[1]) != bytes(push_pull(7)[1])


def test_a_shard_with_a_compiled_path_is_collected():
    """The compiled path holds its shard, which holds it: the collector frees both."""
    if not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    server, _ = shard("async", 1, OPTIMIZERS["momentum"], short=True)
    assert server._short.compiled is not None
    gone = weakref.ref(server)
    del server
    gc.collect()
    assert gone() is None


def test_compiled_push_lets_a_waiting_ssp_pull_go_on():
    """Under ssp a fast worker's pull waits for the slow one; the slow worker's push+pull,
    taken by the compiled path, answers its own pull and lets the waiting one go on, with the
    replies and state of a shard that reads everything the general way."""
    if not compiled.available():
        pytest.skip("ps.shard._compiled is not built")
    a, _ = shard("ssp", 2, OPTIMIZERS["momentum"], short=True)
    b, _ = shard("ssp", 2, OPTIMIZERS["momentum"], short=False)

    both = both_ways(a, b)

    def push_pull(w, req, step):
        grads = [torch.randn(LAYOUT.keys[k].numel, dtype=torch.float64) for k in MINE]
        return both(f"w{w}".encode(), frames_of({"op": "push", "worker": w, "req": req, "step": step,
                                                 "version": a.version, "keys": MINE, "pull": 1, "clock": step + 1},
                                                grads))

    for w in range(2):
        both(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))
    push_pull(0, 1, 0)
    push_pull(1, 1, 0)  # momentum buffers made by the Python path, at each key's first step
    push_pull(0, 2, 1)
    assert push_pull(0, 3, 2) == [] and len(a.waiting) == 1  # clock 3, the slow worker's 1: it waits
    taken = a._short.compiled.taken
    replies = push_pull(1, 2, 1)
    assert [peer for peer, _ in replies] == [b"w1", b"w0"] and a._short.compiled.taken == taken + 1
    assert len(a.waiting) == 0 and a.stats() == b.stats()
    for k in MINE:
        assert torch.equal(a.chunks[k], b.chunks[k])


@pytest.mark.parametrize("back_s", [0.0, 3e-7, 6.2228e-4, 6.6e-4, 0.5, 1e4])
def test_compiled_sync_answers_waiting_pulls_as_the_general_path_whatever_the_clock(back_s):
    """The pulls a sync step's last push lets go on, answered by the compiled path, carry the
    bytes the general path writes (waited_us by the shard's clock, read as often: negative
    where the clock went back, in each of msgpack's widths, and truncated as int() truncates)
    and leave the same waiting counts, with 3 workers of whom 2 wait."""
    if not compiled.available():
        pytest.skip("ps.shard._compiled is not built")

    class Back(Clock):
        def __call__(self):
            self.now -= back_s
            return self.now

    a, _ = shard("sync", 3, OPTIMIZERS["momentum"], short=True)
    b, _ = shard("sync", 3, OPTIMIZERS["momentum"], short=False)
    a.clock, b.clock = Back(), Back()
    both = both_ways(a, b)
    for w in range(3):
        both(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))
    torch.manual_seed(1)
    for step in range(4):
        for w in (2, 0, 1):
            grads = [torch.randn(LAYOUT.keys[k].numel, dtype=torch.float64) for k in MINE]
            replies = both(f"w{w}".encode(), frames_of({"op": "push", "worker": w, "req": step + 1, "step": step,
                                                        "version": step, "keys": MINE, "pull": 1,
                                                        "min_version": step + 1}, grads))
            a.clock.now += 1.234567e-3  # between messages
            b.clock.now += 1.234567e-3
        waited = [msgpack.unpackb(bytes(f[0]))["waited_us"] for _, f in replies[1:]]
        assert len(waited) == 2 and (min(waited) < 0) == (back_s > 6e-4)
    assert a.waiting.waits == b.waiting.waits and a.waiting.waits["count"] == 8
    assert a._short.compiled.released == 6 and a.stats() == b.stats()  # the first step makes the momentum: Python's


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_pull_that_waited_is_answered_in_the_bytes_encode_writes(mode):
    """A sync step's first push+pulls wait for the last worker's (ssp's, for the slowest
    worker's clock); their replies come from the chunks' own bytes (ShardServer.whole_values),
    byte for byte the frames ps.protocol.encode writes for the same header and the keys'
    values; keys that are not whole here it leaves to encode."""
    server, _ = shard(mode, 2, OPTIMIZERS["momentum"], short=True)
    for w in range(2):
        server.handle(f"w{w}".encode(), encode({"op": "join", "worker": w, "req": 0}))

    def push_pull(w, req, step):
        grads = [torch.randn(LAYOUT.keys[k].numel, dtype=torch.float64) for k in MINE]
        header = {"op": "push", "worker": w, "req": req, "step": step, "version": server.version, "keys": MINE,
                  "pull": 1, **({"min_version": step + 1} if mode == "sync" else {"clock": step + 1})}
        return server.handle(f"w{w}".encode(), frames_of(header, grads))

    if mode == "ssp":
        push_pull(0, 1, 0)  # worker 0 one clock ahead: its next pull waits for worker 1's
    for step in range(3):
        ahead = step + 1 if mode == "ssp" else step
        assert push_pull(0, ahead + 1, ahead) == [] and len(server.waiting) == 1
        replies = push_pull(1, step + 1, step)
        assert [peer for peer, _ in replies] == [b"w1", b"w0"]
        frames = replies[1][1]
        header = msgpack.unpackb(bytes(frames[0]))
        assert "waited_us" in header and header["keys"] == MINE
        expected = encode({k: v for k, v in header.items() if k not in ("v", "dtypes", "shapes")},
                          [server.chunks[k].detach().reshape(-1) for k in MINE])
        assert [bytes(f) for f in frames] == [bytes(f) for f in expected]
        assert all(f.obj is server.snapshots._arrays[k] for f, k in zip(frames[1:], MINE))  # the chunks' own
    assert server.whole_values({"op": "ok"}, [OTHER[0]]) is None  # another shard's key: encode's
