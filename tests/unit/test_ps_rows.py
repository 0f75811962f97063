"""Row-sparse keys on a shard, without sockets: pushes and pulls by rows are validated before
they touch anything, a sync step sums every worker's rows and updates only those rows (the
dense update exactly, for SGD and Adagrad, in float64), and async shards count collisions."""

import random

import pytest
import torch

from ps.config import PSConfig
from ps.layout import ParamSpec, build_layout, split_values
from ps.protocol import Limits, ProtocolError, decode, encode
from ps.shard import ShardServer

ROWS, DIM = 40, 3
SPECS = [ParamSpec("table", (ROWS, DIM), "float64"), ParamSpec("bias", (5,), "float64")]
LAYOUT = build_layout(SPECS, 1, 60, sparse=[0])  # the table in keys of 20 rows, the bias whole
TABLE_KEYS = [k.id for k in LAYOUT.param_keys(0)]
BIAS = LAYOUT.param_keys(1)[0].id
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.5),
              "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.5)}


def init():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s.shape, dtype=torch.float64, generator=gen) for s in SPECS]


def make(mode, optimizer="sgd", workers=2):
    server = ShardServer(0, LAYOUT, split_values(LAYOUT, init(), 0), OPTIMIZERS[optimizer], mode, workers,
                         PSConfig(async_scale="sum"))
    for w in range(workers):
        assert call(server, w, "join")[0].op == "ok"
    return server


def call(server, worker, op, tensors=None, ids=None, **fields):
    replies = server.handle(f"w{worker}".encode(),
                            encode({"op": op, "worker": worker, "req": 7, **fields}, tensors, ids))
    return [decode(frames, LAYOUT) for _, frames in replies]


def split_rows(ids, rows):
    """{key: (ids within the key, rows)} of table rows (ids sorted, unique)."""
    out = {}
    for kid in TABLE_KEYS:
        first, n = LAYOUT.key_rows(kid)
        mask = (ids >= first) & (ids < first + n)
        out[kid] = (ids[mask] - first, rows[mask])
    return out


def push_rows(server, worker, step, ids, rows, bias, version=None):
    parts = split_rows(ids, rows)
    keys = [*TABLE_KEYS, BIAS]
    return call(server, worker, "push", [parts[k][1] for k in TABLE_KEYS] + [bias],
                [parts[k][0] for k in TABLE_KEYS] + [None], step=step,
                version=step if version is None else version, keys=keys)


def table(server):
    return torch.cat([server.chunks[k] for k in TABLE_KEYS])


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sync_rows_of_every_worker_summed_equal_the_dense_update(optimizer):
    server = make("sync", optimizer)
    reference = [p.clone().requires_grad_() for p in init()]
    dense = OPTIMIZERS[optimizer](reference)
    rng = torch.Generator().manual_seed(1)
    for step in range(4):
        grads = [torch.zeros(ROWS, DIM, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)]
        for w in range(2):
            ids = torch.randperm(ROWS, generator=rng)[:9].sort().values  # overlapping between workers
            rows, bias = torch.randn(9, DIM, generator=rng, dtype=torch.float64), torch.randn(5, dtype=torch.float64, generator=rng)
            grads[0][ids] += rows / 2
            grads[1] += bias / 2
            assert push_rows(server, w, step, ids, rows, bias)[0].op == "ok"
        for p, g in zip(reference, grads):
            p.grad = g
        dense.step()
        assert server.version == step + 1
        assert torch.allclose(table(server), reference[0].detach(), rtol=0, atol=1e-14)
        assert torch.allclose(server.chunks[BIAS], reference[1].detach(), rtol=0, atol=1e-14)
    assert server.counters["rows_pushed"] == 4 * 2 * 9


def test_pull_by_rows_returns_just_those_rows():
    server = make("sync")
    ids = {TABLE_KEYS[0]: torch.tensor([0, 5, 19]), TABLE_KEYS[1]: torch.tensor([], dtype=torch.int64)}
    reply = call(server, 1, "pull", None, [ids[k] for k in TABLE_KEYS], keys=TABLE_KEYS)[0]
    assert reply.op == "ok" and reply.ids[0].tolist() == [0, 5, 19] and reply.ids[1].numel() == 0
    assert torch.equal(reply.tensors[0], table(server)[[0, 5, 19]])
    assert reply.tensors[1].shape == (0, DIM)
    reply.tensors[0].fill_(7.0)  # a copy: the shard's rows are not the reply's
    assert not (table(server) == 7.0).any()
    assert server.counters["rows_pulled"] == 3


def test_async_counts_rows_another_worker_changed_since_the_pull():
    server = make("async")
    one = torch.ones(1, DIM, dtype=torch.float64)
    bias = torch.zeros(5, dtype=torch.float64)
    for w in range(2):
        call(server, w, "pull", None, [torch.tensor([3]), torch.tensor([], dtype=torch.int64)], keys=TABLE_KEYS)
    assert push_rows(server, 0, 0, torch.tensor([3]), one, bias)[0].op == "ok"
    assert server.counters["row_collisions"] == 0  # nobody had changed row 3 since worker 0 read it
    push_rows(server, 1, 0, torch.tensor([3, 25]), torch.ones(2, DIM, dtype=torch.float64), bias)
    assert server.counters["row_collisions"] == 1  # row 3: worker 0 changed it after worker 1 read it
    call(server, 1, "pull", None, [torch.tensor([3]), torch.tensor([], dtype=torch.int64)], keys=TABLE_KEYS)
    push_rows(server, 1, 1, torch.tensor([3]), one, bias)
    assert server.counters["row_collisions"] == 1  # read again since: no collision
    assert server.counters["rows_pushed"] == 4


def _bad_pushes():
    ok_ids = [torch.tensor([1, 2]), torch.tensor([], dtype=torch.int64), None]
    rows = [torch.ones(2, DIM, dtype=torch.float64), torch.ones(0, DIM, dtype=torch.float64),
            torch.ones(5, dtype=torch.float64)]
    header = {"op": "push", "worker": 0, "req": 3, "step": 0, "version": 0, "keys": [*TABLE_KEYS, BIAS]}

    def frames(ids=ok_ids, tensors=rows, **changes):
        return encode({**header, **changes}, tensors, ids)

    def patched(index, data):
        f = frames()
        return [*f[:index], data, *f[index + 1:]]

    twenty = torch.arange(21)  # a key holds 20 rows
    return {
        "unsorted ids": (frames([torch.tensor([2, 1]), *ok_ids[1:]]), "strictly increasing"),
        "repeated ids": (frames([torch.tensor([2, 2]), *ok_ids[1:]]), "strictly increasing"),
        "negative id": (frames([torch.tensor([-1, 2]), *ok_ids[1:]]), "strictly increasing"),
        "id past the key": (frames([torch.tensor([1, 20]), *ok_ids[1:]]), "within 0..19"),
        "more rows than the key": (frames([twenty, *ok_ids[1:]], [torch.ones(21, DIM, dtype=torch.float64), *rows[1:]]),
                                   "the key holds 20"),
        "dense key by rows": (frames([*ok_ids[:2], torch.tensor([0])], [*rows[:2], torch.ones(1, 5, dtype=torch.float64)]),
                              "dense parameter"),
        "rows of the wrong width": (frames(ok_ids, [torch.ones(2, DIM + 1, dtype=torch.float64), *rows[1:]]),
                                    r"does not match the rows' \[2, 3\]"),
        "ids frame short": (patched(1, b"\0" * 8), "row id frame is 8 bytes; expected 16"),
        "rows entry negative": (_with_rows([-2, 0, -1], frames()), "rows entry -2"),
        "rows count off": (_with_rows([2, 0], frames()), "'rows' has 2 entries for 3 keys"),
        "frame missing": (frames()[:-1], "tensor frame"),
    }


def _with_rows(rows, frames):
    import msgpack

    header = msgpack.unpackb(frames[0])
    header["rows"] = rows
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize("name", list(_bad_pushes()))
def test_bad_row_pushes_are_refused_and_change_nothing(name):
    frames, message = _bad_pushes()[name]
    with pytest.raises(ProtocolError, match=message):
        decode(frames, LAYOUT, limits=Limits())
    server = make("sync")
    before = table(server).clone()
    reply = decode(server.handle(b"w0", frames)[0][1])
    assert reply.op == "error" and message.replace("\\", "") .split("[")[0][:20] in reply.get("error")
    assert torch.equal(table(server), before) and server.counters["pushes"] == 0


def test_push_by_rows_that_asks_for_values_is_refused_and_changes_nothing():
    server = make("sync")
    before = table(server).clone()
    ids, rows = torch.tensor([1, 2]), torch.ones(2, DIM, dtype=torch.float64)
    parts = split_rows(ids, rows)
    (reply,) = call(server, 0, "push", [parts[k][1] for k in TABLE_KEYS] + [torch.ones(5, dtype=torch.float64)],
                    [parts[k][0] for k in TABLE_KEYS] + [None], step=0, version=0, keys=[*TABLE_KEYS, BIAS], pull=1)
    assert reply.op == "error" and "a push by rows cannot ask for values" in reply.get("error")
    assert torch.equal(table(server), before) and server.counters["pushes"] == 0


@pytest.mark.timeout(60)
def test_fuzzed_row_messages_never_crash_or_touch_the_shard():
    """Random corruption of valid row pushes and pulls on an async shard (where a push applies
    at once): every message is answered, and each one answered with an error left the
    shard's values as they were."""
    server = make("async")
    good = [encode({"op": "push", "worker": 1, "req": 1, "step": 0, "version": 0, "keys": TABLE_KEYS},
                   [torch.ones(2, DIM, dtype=torch.float64), torch.ones(1, DIM, dtype=torch.float64)],
                   [torch.tensor([3, 4]), torch.tensor([7])]),
            encode({"op": "pull", "worker": 1, "req": 2, "keys": TABLE_KEYS}, None,
                   [torch.tensor([0, 19]), torch.tensor([1])])]
    rng = random.Random(0)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):
        frames = [bytes(f) for f in rng.choice(good)]
        i = rng.randrange(len(frames))
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            if data and rng.random() < 0.7:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif data and rng.random() < 0.5:
                del data[rng.randrange(len(data)):]
            else:
                data += rng.randbytes(rng.randint(1, 16))
        frames[i] = bytes(data)
        if rng.random() < 0.1 and len(frames) > 1:
            frames.pop(rng.randrange(1, len(frames)))
        before = table(server).clone()
        replies = [decode(reply, LAYOUT) for _, reply in server.handle(b"w1", frames)]
        assert len(replies) == 1 and replies[0].op in outcomes
        outcomes[replies[0].op] += 1
        if replies[0].op == "error":
            assert torch.equal(table(server), before)
    assert outcomes["error"] > 2000 and server.counters["malformed"] + server.counters["rejected"] == outcomes["error"]


def test_row_ids_in_order_are_strictly_increasing_within_the_key():
    from ps.protocol_checks import rows_in_order

    ids = torch.tensor
    assert rows_in_order(ids([], dtype=torch.int64), 20) and rows_in_order(ids([0]), 1) and rows_in_order(ids([0, 5, 19]), 20)
    for bad, limit in (([2, 1], 20), ([2, 2], 20), ([-1, 2], 20), ([1, 20], 20), ([0], 0), ([3, 4, 4, 9], 20)):
        assert not rows_in_order(ids(bad), limit), bad
