"""A worker's compiled lane (ps.client_compiled) sends the bytes the Python paths send, reads
a reply into what they read from it, and leaves to them, unsent or unread, what it does not
take. Each worker here speaks to ROUTER sockets standing in for its shards, so that the test
sees every byte on the wire and writes every reply."""

import random

import msgpack
import pytest
import torch
import zmq

from ps import client_compiled
from ps.client import PSClient
from ps.flight import PSError
from ps.layout import ParamSpec, build_layout
from ps.protocol import encode
from ps.protocol_short import WholeKeys
from ps.transport import TransportError

pytestmark = pytest.mark.skipif(not client_compiled.available(), reason="ps._client is not built")

SPECS = [ParamSpec("w", (4, 3), "float32"), ParamSpec("b", (3,), "float64"), ParamSpec("h", (5,), "float16"),
         ParamSpec("e", (6,), "bfloat16"), ParamSpec("big", (40000,), "float32")]
LAYOUT = build_layout(SPECS, 2, 1 << 20)
"""Keys 0-2: float32, float64 and float16 the lane takes, and 4 and 5, 80 KB of float32 each
(above the 64 KiB it copies: lent to ZeroMQ), too; 3, bfloat16 (no numpy dtype), it leaves to
Python."""


def joined(client, layout, lane=True):
    """client as join() leaves it on layout, with its compiled lane or without."""
    client.layout = layout
    client._whole = [WholeKeys(layout, [k.id for k in layout.shard_keys(s)], client._limits)
                     for s in range(layout.num_shards)]
    client._lane = client_compiled.lane_for(client) if lane else None
    assert (client._lane is not None) == lane
    return client


@pytest.fixture
def wired():
    """(compiled?, timeout, layout) -> (a joined client, its shards' ROUTER sockets)."""
    made = []

    def make(lane: bool = True, timeout_s: float = 5.0, layout=LAYOUT, worker: int = 1):
        ctx = zmq.Context()
        routers = [ctx.socket(zmq.ROUTER) for _ in range(layout.num_shards)]
        addresses = [f"inproc://lane-{id(ctx)}-{s}" for s in range(layout.num_shards)]
        for r, a in zip(routers, addresses):
            r.bind(a)
        client = PSClient(addresses, worker=worker, timeout_s=timeout_s, context=ctx)
        client.versions.update({0: 3, 1: 5})
        joined(client, layout, lane)
        made.append((client, routers, ctx))
        return client, routers

    yield make
    for client, routers, ctx in made:
        client.close()
        for r in routers:
            r.close(0)
        ctx.term()


def received(router):
    """(identity, header as ordered pairs, data frames' bytes) of the next message."""
    assert router.poll(5000), "nothing arrived"
    identity, header, *data = router.recv_multipart()
    return identity, msgpack.unpackb(header, object_pairs_hook=list), header, data


def grads_of(keys, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(LAYOUT.keys[k].numel, generator=gen, dtype=torch.float64).to(
        getattr(torch, LAYOUT.key_dtype[k])) for k in keys}


CALLS = [dict(pull=True), dict(pull=False), dict(pull=True, lr=0.25), dict(pull=True, next_version=True),
         dict(pull=True, clock=7), dict(pull=False, hold=True), dict(pull=True, lr=3, clock=0)]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("keys", [[0], [1], [2], [4], [0, 1, 2], [2, 0], [5, 4, 1, 0]])
@pytest.mark.parametrize("step,version", [(4, None), (0, 2), (None, None), (1 << 40, 7)])
def test_a_push_leaves_in_the_bytes_the_python_path_writes(wired, call, keys, step, version):
    """Every shard's message, header and frames, as the Python path writes it (only the request
    id differs: each client counts its own), and each header in msgpack's own encoding."""
    by_lane, lane_routers = wired(lane=True)
    by_python, python_routers = wired(lane=False)
    grads = grads_of(keys)
    lane_handle = by_lane.push(step, version, grads, **call)
    python_handle = by_python.push(step, version, grads, **call)
    assert by_lane.bytes_sent == by_python.bytes_sent
    assert lane_handle.kind == python_handle.kind and lane_handle.timeout_s == python_handle.timeout_s
    assert sorted(lane_handle.pending.values()) == sorted(python_handle.pending.values())
    for s in sorted(set(python_handle.pending.values())):
        _, lane_pairs, lane_raw, lane_data = received(lane_routers[s])
        _, python_pairs, _, python_data = received(python_routers[s])
        assert lane_pairs[-1][0] == python_pairs[-1][0] == "req"
        assert lane_pairs[:-1] == python_pairs[:-1] and lane_data == python_data
        assert lane_raw == msgpack.packb(dict(lane_pairs), use_bin_type=True)
        assert by_lane._inflight[lane_pairs[-1][1]] is lane_handle


@pytest.mark.parametrize("grads", [
    {3: torch.ones(6, dtype=torch.bfloat16)},  # no numpy dtype
    {0: torch.ones(12, requires_grad=True)},  # needs grad: Python detaches it
    {0: torch.ones(24)[::2]},  # not contiguous: Python makes it so
    {0: torch.ones(12, dtype=torch.float64)},  # another dtype: Python names it
    {0: torch.ones(13)},  # another size: Python names it
    {7: torch.ones(3)},  # not a key
    {0: torch.nn.Parameter(torch.ones(12), requires_grad=False)},  # a subclass of Tensor
    {0: (torch.tensor([0]), torch.ones(1, 12))},  # rows
])
def test_what_the_lane_does_not_take_it_leaves_unsent(wired, grads):
    client, routers = wired()
    assert client._lane.push(grads, 0, None, True, None, False, False, None, 5.0) is None
    assert not routers[0].poll(50) and not routers[1].poll(0)


def test_the_python_path_sends_what_the_lane_leaves(wired):
    client, routers = wired()
    g = torch.ones(12, requires_grad=True)
    client.push(0, None, {0: g}, pull=True)
    _, pairs, _, data = received(routers[LAYOUT.keys[0].shard])
    assert dict(pairs)["keys"] == [0] and data == [torch.ones(12).numpy().tobytes()]
    with pytest.raises(ValueError, match="needs 12 float32 values"):
        client.push(0, None, {0: torch.ones(13)}, pull=True)


def reply_frames(keys, seed=1, **fields):
    header = {"op": "ok", "worker": 1, "version": 6, "keys": keys, **fields}
    return header, grads_of(keys, seed=seed)


@pytest.mark.parametrize("fields", [{}, {"staleness": 2, "waited_us": 40}, {"staleness": None, "version": None}])
def test_a_reply_reads_into_the_result_the_python_path_gives(wired, fields):
    results = []
    for lane in (True, False):
        client, routers = wired(lane=lane)
        keys = [k.id for k in LAYOUT.shard_keys(0) if k.id < 3]
        handle = client.push(9, None, grads_of(keys), pull=True)
        identity, pairs, _, _ = received(routers[0])
        header, values = reply_frames(keys, **{**fields, "req": dict(pairs)["req"]})
        routers[0].send_multipart([identity, *encode(header, [values[k] for k in keys])])
        result = client.wait(handle)
        results.append((result, dict(client.versions), client.bytes_recv))
        assert all(torch.equal(result.values[k], values[k]) for k in keys)
    (a, va, na), (b, vb, nb) = results
    assert va == vb and na == nb
    assert (a.version, a.versions, a.staleness, a.waited_s, a.kind) == (b.version, b.versions, b.staleness, b.waited_s,
                                                                        b.kind)
    assert a.values.keys() == b.values.keys() and all(
        x.dtype == b.values[k].dtype and torch.equal(x.double(), b.values[k].double()) for k, x in a.values.items())


def outcome(client, routers, frames_of):
    """What wait makes of the reply frames_of(req) to a push+pull of key 0."""
    handle = client.push(1, None, grads_of([0]), pull=True)
    s = LAYOUT.keys[0].shard
    identity, pairs, _, _ = received(routers[s])
    routers[s].send_multipart([identity, *frames_of(dict(pairs)["req"])])
    try:
        result = client.wait(handle, timeout_s=0.3)
    except Exception as e:  # noqa: BLE001 (the kind and the words are what is compared)
        text = str(e).replace(client.addresses[s], "the shard")
        return type(e).__name__, text.split("req ")[0] if "within" in text else text
    return "ok", result.version, result.staleness, {k: v.double().tolist() for k, v in result.values.items()}


def test_a_changed_reply_is_read_or_refused_as_the_python_path_reads_or_refuses_it(wired):
    """700 replies with a byte of the header changed, dropped or added, and a data frame cut or
    grown: the lane reads each into what the Python paths make of it, or leaves it to them."""
    rng = random.Random(0)
    seen = set()
    clients = [wired(lane=True, timeout_s=0.3), wired(lane=False, timeout_s=0.3)]
    for trial in range(700):
        how, at, byte = rng.randrange(5), rng.random(), rng.randrange(256)

        def frames_of(req):
            header, values = reply_frames([0], req=req)
            head, data = encode(header, [values[0]])
            head = bytearray(head)
            i = int(at * len(head))
            if how == 0:
                head[i] = byte
            elif how == 1:
                del head[i]
            elif how == 2:
                head.insert(i, byte)
            data = bytes(data)
            if how == 3:
                data = data[:-4]
            elif how == 4:
                data += b"\0" * 4
            return [bytes(head), data]

        got = [outcome(c, r, frames_of) for c, r in clients]
        assert got[0] == got[1], (trial, how, got)
        seen.add(got[0][0])
    assert {"ok", "PSError"} <= seen


def test_a_send_that_cannot_leave_says_so_as_the_transport_does():
    """Nobody at the address: messages queue up to the high-water mark, then a send waits its
    time and fails, the lane's with the errno the transport turns into its own words."""
    import errno

    from experiments.runtime.launcher import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    layout = build_layout(SPECS[:1], 1, 1 << 20)
    for lane in (True, False):
        ctx = zmq.Context()
        client = joined(PSClient([address], worker=0, timeout_s=0.2, context=ctx), layout, lane)
        try:
            if lane:
                with pytest.raises(client_compiled.SendFailed) as failed:
                    for step in range(1 << 20):
                        client._lane.push({0: torch.ones(12)}, step, None, True, None, False, False, None, 0.2)
                assert failed.value.args == (0, errno.EAGAIN, 0, {})
                error = client._transports[0].send_failed(errno.EAGAIN)
                assert type(error) is TransportError and str(error) == f"could not send to {address}: its queue stayed full"
            else:
                with pytest.raises(TransportError, match=f"could not send to {address}: its queue stayed full"):
                    for step in range(1 << 20):
                        client.push(step, None, {0: torch.ones(12)}, pull=True)
        finally:
            client.close()
            ctx.term()


def test_a_closed_lane_takes_nothing(wired):
    client, _ = wired()
    lane = client._lane
    client.close()
    assert lane.push({0: torch.ones(12)}, 0, None, True, None, False, False, None, 5.0) is None
    with pytest.raises(RuntimeError, match="closed"):
        lane.take(0)


def test_an_error_reply_is_the_python_paths_to_read(wired):
    client, routers = wired()
    handle = client.push(1, None, grads_of([0]), pull=True)
    s = LAYOUT.keys[0].shard
    identity, pairs, _, _ = received(routers[s])
    routers[s].send_multipart([identity, *encode({"op": "error", "worker": 1, "req": dict(pairs)["req"],
                                                  "error": "no such step"})])
    with pytest.raises(PSError, match="no such step"):
        client.wait(handle)


def test_a_lent_frame_stays_whole_until_zeromq_is_done_with_it(wired):
    """A frame above 64 KiB leaves without a copy: its tensor's memory is held (the caller's
    references gone) until ZeroMQ has sent it, and let go after."""
    import gc
    import time

    client, routers = wired()
    expected = torch.arange(20000, dtype=torch.float32)
    s = LAYOUT.keys[4].shard
    for _ in range(3):
        g = expected.clone()
        client.push(0, None, {4: g}, pull=True)
        del g
        gc.collect()
        torch.arange(20000, dtype=torch.float32).mul_(7)  # what the allocator might hand the freed memory to
        _, _, _, data = received(routers[s])
        assert data == [expected.numpy().tobytes()]
    deadline = time.monotonic() + 5
    while client._lane.leased() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client._lane.leased() == 0


def test_a_handle_waits_as_long_as_the_client_says_now(wired):
    client, _ = wired()
    client.timeout_s = 30.0
    assert client.push(0, None, grads_of([0]), pull=True).timeout_s == 30.0
    assert client.push(1, None, grads_of([0]), pull=True, clock=2).timeout_s == 35.0


def test_a_reply_from_any_of_many_shards_is_taken(wired):
    """The lane polls every shard's socket (70 here), the last as the first."""
    shards = 70
    layout = build_layout([ParamSpec(f"p{s}", (3,), "float32") for s in range(shards)], shards, 1 << 20)
    client, routers = wired(layout=layout)
    key = layout.shard_keys(shards - 1)[0].id
    handle = client.push(0, None, {key: torch.ones(3)}, pull=True)
    identity, pairs, _, _ = received(routers[shards - 1])
    routers[shards - 1].send_multipart([identity, *encode(
        {"op": "ok", "worker": 1, "req": dict(pairs)["req"], "version": 1, "keys": [key]}, [torch.full((3,), 2.0)])])
    assert torch.equal(client.wait(handle).values[key], torch.full((3,), 2.0))


class Recorded:
    """A lane whose sent push+pulls are noted (their request ids), the rest its own."""

    def __init__(self, lane):
        self.lane, self.sent = lane, []

    def push(self, *args):
        sent = self.lane.push(*args)
        if sent is not None:
            self.sent += list(sent[0].pending)
        return sent

    def __getattr__(self, name):
        return getattr(self.lane, name)


@pytest.fixture
def windowed(wired, monkeypatch):
    """wired's (lane?) -> (client, routers), the client pushing through a window of
    window bytes, its lane recorded and never leaving a push to the transport's monitor."""
    monkeypatch.setattr(client_compiled, "MONITOR_DRAIN_S", 1e15)

    def make(lane: bool, window: int):
        client, routers = wired(lane=lane)
        client._window = window
        if lane:
            client._lane = Recorded(client._lane)
        return client, routers

    return make


def answer(router, values=None):
    """Answer the next push+pull on router with its keys' values (each grads_of's, seed 1);
    the request answered."""
    identity, pairs, _, _ = received(router)
    fields = dict(pairs)
    header, vals = reply_frames(fields["keys"], req=fields["req"])
    router.send_multipart([identity, *encode(header, [vals[k] for k in fields["keys"]])])
    return fields["req"]


def window_state(client):
    return (dict(client._unanswered), dict(client._counted), {s: [m[:2] for m in h] for s, h in client._held.items() if h},
            client.bytes_sent)


@pytest.mark.parametrize("keys", [[0], [0, 1, 2], [5, 4, 1, 0]])
def test_under_a_window_the_lane_sends_what_it_lets_through_and_counts_it_as_python_does(windowed, keys):
    """ps-sync's workers push through a window (ps.window_mb): a push+pull the window sends at
    once leaves by the lane, counted in the window as the Python path counts its own (the same
    bytes); one it holds back (no room, or others held for the shard) the Python path holds,
    whatever the lane, and a reply lets it go as before."""
    window = 120_000  # room for a push of key 4 or 5 (80 KB each) on its shard, not for a second
    by_lane, lane_routers = windowed(True, window)
    by_python, python_routers = windowed(False, window)
    grads = grads_of(keys)
    first = [c.push(3, None, grads, pull=True, next_version=True) for c in (by_lane, by_python)]
    assert by_lane._lane.sent == list(first[0].pending)  # all of it by the lane
    assert window_state(by_lane) == window_state(by_python) and by_lane._unanswered
    second = [c.push(4, None, grads, pull=True, next_version=True, priority=1) for c in (by_lane, by_python)]
    big = 4 in keys
    assert (by_lane._lane.sent == list(first[0].pending)) == big  # held (Python's) where it did not fit
    assert window_state(by_lane) == window_state(by_python) and any(by_lane._held.values()) == big
    third = [c.push(5, None, grads_of([0]), pull=True, next_version=True, priority=0) for c in (by_lane, by_python)]
    assert window_state(by_lane) == window_state(by_python)  # behind held messages: held too
    orders = []
    for c, routers, handles in ((by_lane, lane_routers, (first[0], second[0], third[0])),
                                (by_python, python_routers, (first[1], second[1], third[1]))):
        order = []
        orders.append(order)
        for h in handles:  # each shard's messages answered as they arrive (held ones leave by priority)
            while h.pending:
                s = next(iter(sorted(set(h.pending.values()))))
                order.append(answer(routers[s]))
                c._progress(5.0, drain=True)
            c.wait(h)
        assert not c._unanswered or not any(c._unanswered.values())
        assert not c._counted and not any(c._held.values())
    assert window_state(by_lane) == window_state(by_python) and orders[0] == orders[1]


@pytest.mark.parametrize("call", CALLS + [dict(pull=True, lr=0.25, hold=True, next_version=True, clock=7)])
@pytest.mark.parametrize("keys", [[0], [1], [2], [4], [0, 1, 2], [5, 4, 1, 0]])
def test_a_lane_message_is_never_larger_than_the_window_counts_it_before(wired, call, keys):
    """The window decides for the lane with its keys' bytes and the most a header adds
    (client_window.LANE_HEADER_BYTES, LANE_KEY_BYTES a key): with every integer at its widest,
    each message the lane writes is within that."""
    import itertools

    from ps.client_window import LANE_HEADER_BYTES, LANE_KEY_BYTES

    widest = (1 << 62) - 100  # the protocol's integers are below 1 << 62 (msgpack: 9 bytes from 1 << 32)
    client, routers = wired(worker=widest)
    client._reqs = itertools.count(widest)
    client.versions.update({0: widest, 1: widest + 1})
    args = dict(pull=False, lr=None, hold=False, next_version=False, clock=None) | call
    if args["clock"] is not None:
        args["clock"] = widest + args["clock"]
    for _ in range(3):  # (a shard's first push is the transport's: it reads its monitor)
        sent = client._lane.push(grads_of(keys), widest, None, args["pull"], args["lr"], args["hold"],
                                 args["next_version"], args["clock"], 5.0)
        if sent is not None:
            break
    assert sent is not None
    handle, nbytes, sizes = sent
    assert sum(sizes.values()) == nbytes and sizes.keys() == handle.pending.keys()
    for req, s in handle.pending.items():
        own = [k for k in keys if LAYOUT.keys[k].shard == s]
        data = sum(LAYOUT.nbytes(k) for k in own)
        assert data < sizes[req] <= data + LANE_HEADER_BYTES + LANE_KEY_BYTES * len(own)
        _, _, raw, frames = received(routers[s])
        assert len(raw) + sum(map(len, frames)) == sizes[req]


def test_a_send_that_fails_after_others_left_leaves_them_counted_in_the_window(monkeypatch):
    """A push+pull to two shards whose second cannot leave (its queue full, nobody there):
    the message to the first is in flight, and the window counts it as the Python path,
    which counts each message as it sends it, does."""
    from experiments.runtime.launcher import free_port

    monkeypatch.setattr(client_compiled, "MONITOR_DRAIN_S", 1e15)
    k0, k1 = (next(k for k in (0, 1, 2) if LAYOUT.key_shard[k] == s) for s in (0, 1))
    states = []
    for lane in (True, False):
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"inproc://failed-{lane}")
        client = joined(PSClient([f"inproc://failed-{lane}", f"tcp://127.0.0.1:{free_port()}"], worker=1,
                                 timeout_s=0.2, context=ctx), LAYOUT, lane)
        client._window = 1 << 20
        try:
            with pytest.raises(TransportError):
                for step in range(1 << 20):  # shard 1's queue fills with pushes (never held)
                    client.push(step, None, grads_of([k1]), pull=False)
            with pytest.raises(TransportError, match="queue stayed full"):
                client.push(0, None, grads_of([k0, k1]), pull=True)
            states.append(window_state(client)[:3])
            assert client._unanswered[0] > 0 and len(client._counted) == 1
        finally:
            client.close()
            router.close(0)
            ctx.term()
    assert states[0] == states[1]
