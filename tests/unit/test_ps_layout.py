"""Layout (pure) and PSConfig validation: table-driven."""

import math

import pytest
import torch

from ps.config import PSConfig, key_mb
from ps.layout import (MIN_CHUNK_ELEMS, MIN_SHARE_ELEMS, Layout, ParamSpec, build_layout, chunk_elems_from_mb, join_values,
                       split_values)

MLP_WIDE = [ParamSpec("0.weight", (4096, 784), "float32"), ParamSpec("0.bias", (4096,), "float32"),
            ParamSpec("2.weight", (4096, 4096), "float32"), ParamSpec("2.bias", (4096,), "float32"),
            ParamSpec("4.weight", (10, 4096), "float32"), ParamSpec("4.bias", (10,), "float32")]
CNN = [ParamSpec("c1.w", (16, 1, 5, 5), "float32"), ParamSpec("c1.b", (16,), "float32"),
       ParamSpec("bn1.w", (16,), "float32"), ParamSpec("c2.w", (32, 16, 5, 5), "float32"),
       ParamSpec("fc.w", (10, 1568), "float32"), ParamSpec("fc.b", (10,), "float32")]
MIXED = [ParamSpec("a", (300_000,), "float64"), ParamSpec("b", (70_000,), "float16"),
         ParamSpec("c", (3, 0), "float32"), ParamSpec("d", (), "bfloat16"), ParamSpec("e", (1000, 1000), "float32")]

# (specs, shards, chunk_mb, bound on max/min shard bytes)
BALANCE = [(MLP_WIDE, n, mb, 1.02) for n in (1, 2, 3, 4) for mb in (4.0, 1.0, 1024.0)] + [
    (MLP_WIDE, 8, 4.0, 1.02), (MIXED, 3, 1.0, 1.05)]


@pytest.mark.parametrize("specs,shards,chunk_mb,bound", BALANCE)
def test_balance(specs, shards, chunk_mb, bound):
    layout = build_layout(specs, shards, chunk_elems_from_mb(chunk_mb))
    per_shard = layout.bytes_per_shard()
    assert sum(per_shard) == sum(s.numel * s.itemsize for s in specs)
    assert max(per_shard) / min(per_shard) <= bound, per_shard
    assert max(per_shard) - min(per_shard) <= max(layout.nbytes(k) for k in layout.keys)  # greedy's guarantee
    assert max(k.numel for k in layout.keys) <= chunk_elems_from_mb(chunk_mb)


MLP_256 = [ParamSpec("0.weight", (256, 784), "float32"), ParamSpec("0.bias", (256,), "float32"),
           ParamSpec("2.weight", (256, 256), "float32"), ParamSpec("2.bias", (256,), "float32"),
           ParamSpec("4.weight", (10, 256), "float32"), ParamSpec("4.bias", (10,), "float32")]


@pytest.mark.parametrize("shards,bound", [(2, 1.02), (3, 1.03), (4, 1.04), (8, 1.07), (16, 1.15)])
def test_a_small_model_spreads_over_many_shards(shards, bound):
    """0.27 M elements, so a shard's share is below MIN_CHUNK_ELEMS: pieces go down to a
    quarter of it (more than half of MIN_SHARE_ELEMS) and every shard holds near its share."""
    layout = build_layout(MLP_256, shards, chunk_elems_from_mb(0.5))
    per_shard = layout.bytes_per_shard()
    assert max(per_shard) / (sum(per_shard) / shards) <= bound, per_shard
    assert min(k.numel for k in layout.keys if MLP_256[k.param].numel >= MIN_SHARE_ELEMS) >= MIN_SHARE_ELEMS // 2 + 1


TINY = [ParamSpec("w", (3, 4), "float32"), ParamSpec("b", (3,), "float32")]  # 15 elements


@pytest.mark.parametrize("specs,shards", [(MLP_256, 64), (TINY, 15)])
def test_every_shard_holds_a_key_while_the_model_has_elements_for_it(specs, shards):
    layout = build_layout(specs, shards, 1 << 20)
    assert all(layout.shard_keys(s) for s in range(shards)) and len(layout.keys) >= shards
    with pytest.raises(ValueError, match="give it at most 15 shards"):
        build_layout(TINY, 16, 1 << 20)


COVERAGE = [(specs, shards, chunk) for specs in (MLP_WIDE, CNN, MIXED)
            for shards, chunk in [(1, 1 << 20), (2, 1 << 18), (3, 1000), (4, 1 << 16)]] + [(CNN, 5, 7)]


@pytest.mark.parametrize("specs,shards,chunk_elems", COVERAGE)
def test_every_element_exactly_once(specs, shards, chunk_elems):
    layout = build_layout(specs, shards, chunk_elems)
    assert [k.id for k in layout.keys] == list(range(len(layout.keys)))
    for p, spec in enumerate(specs):  # intervals that tile [0, numel) with no gap and no overlap
        end = 0
        for key in sorted((k for k in layout.keys if k.param == p), key=lambda k: k.offset):
            assert 0 <= key.shard < shards and key.numel >= 1 or spec.numel == 0
            assert key.offset == end, spec.name
            end += key.numel
        assert end == spec.numel, spec.name
    assert sorted(k.id for s in range(shards) for k in layout.shard_keys(s)) == list(range(len(layout.keys)))


def test_small_tensors_not_split_big_ones_spread():
    layout = build_layout(MLP_WIDE, 4, chunk_elems_from_mb(4.0))
    for p, spec in enumerate(MLP_WIDE):
        keys = layout.param_keys(p)
        if spec.numel <= MIN_CHUNK_ELEMS:
            assert len(keys) == 1, spec.name
        else:
            assert {k.shard for k in keys} == set(range(4)), spec.name  # a big matrix reaches every shard
    assert len(layout.param_keys(2)) == 16  # 16 M floats in <= 4 MiB chunks


def test_deterministic_and_wire_round_trip():
    a, b = build_layout(MIXED, 3, 1000), build_layout(MIXED, 3, 1000)
    assert a.to_wire() == b.to_wire() and a.fingerprint == b.fingerprint
    again = Layout.from_wire(a.to_wire())
    assert again == a and again.keys == a.keys and again.specs == a.specs
    assert build_layout(MIXED, 2, 1000).fingerprint != a.fingerprint


def _wire_with(change):
    wire = build_layout(CNN, 2, 100).to_wire()
    change(wire)
    return wire


@pytest.mark.parametrize("change,message", [
    (lambda w: w.update(v=1), "layout version"),
    (lambda w: w.update(sparse=[99]), "sparse must be a list"),
    (lambda w: w.update(sparse=[1]), "expected 2-D"),
    (lambda w: w.pop("keys"), "fields"),
    (lambda w: w.update(num_shards=0), "num_shards"),
    (lambda w: w["keys"][3].__setitem__(4, 9), "shard < 2"),
    (lambda w: w["keys"][1].__setitem__(0, 5), "id must be 1"),
    (lambda w: w["keys"][1].__setitem__(3, w["keys"][1][3] + 1), "starts at"),
    (lambda w: w["keys"].pop(), "cover"),
    (lambda w: w["params"][0].__setitem__(2, "int64"), "dtype"),
    (lambda w: w["params"][0].__setitem__(1, [-1]), "shape"),
    (lambda w: w["keys"][0].__setitem__(2, "0"), "ints >= 0"),
])
def test_from_wire_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        Layout.from_wire(_wire_with(change))


TABLES = [ParamSpec("emb", (5000, 24), "float32"), ParamSpec("bias", (7,), "float32"),
          ParamSpec("small", (10, 3), "float32")]


@pytest.mark.parametrize("shards,chunk_elems", [(1, 1 << 20), (2, 1000), (3, 7), (4, 1 << 16)])
def test_row_sparse_keys_hold_whole_rows(shards, chunk_elems):
    layout = build_layout(TABLES, shards, chunk_elems, sparse=[0, 2])
    assert layout.sparse == {0, 2} and Layout.from_wire(layout.to_wire()) == layout
    for p in (0, 2):
        rows, dim = TABLES[p].shape
        covered = 0
        for key in layout.param_keys(p):
            first, n = layout.key_rows(key)
            assert first == covered and n * dim == key.numel and n >= 1
            covered += n
        assert covered == rows
    assert layout.row_dim(layout.param_keys(1)[0]) == 0
    with pytest.raises(ValueError, match="not row-sparse"):
        layout.key_rows(layout.param_keys(1)[0])
    assert build_layout(TABLES, shards, chunk_elems).fingerprint != layout.fingerprint


def test_row_sparse_keys_have_their_own_size():
    """sparse_chunk_elems cuts the tables only; the dense parameters keep chunk_elems."""
    small = build_layout(TABLES, 2, 4096)
    layout = build_layout(TABLES, 2, 4096, sparse=[0, 2], sparse_chunk_elems=1 << 20)
    assert len(small.param_keys(0)) == 30 and len(layout.param_keys(0)) == 2  # one per shard
    assert [k.numel for k in layout.param_keys(1)] == [k.numel for k in small.param_keys(1)]
    assert Layout.from_wire(layout.to_wire()) == layout
    with pytest.raises(ValueError, match="sparse_chunk_elems"):
        build_layout(TABLES, 2, 4096, sparse=[0], sparse_chunk_elems=0)


def test_a_runs_tables_take_the_largest_keys_whatever_the_link():
    from experiments.settings.presets import build_config

    cfg = build_config("dlrm", ("net.rate=200mbit",), engine="ps-sync", workers=2)
    assert cfg.key_mb() == 0.125 and cfg.sparse_key_mb() == 4.0
    given = build_config("dlrm", ("net.rate=200mbit", "ps.chunk_mb=1"), engine="ps-sync", workers=2)
    assert given.key_mb() == given.sparse_key_mb() == 1


def test_keys_are_sized_by_the_bytes_their_messages_carry():
    from experiments.settings.presets import build_config

    def cfg(engine, *extra):
        return build_config("mlp-mid", ("net.rate=100mbit", *extra), engine=engine, workers=2, servers=2)

    assert cfg("ps-sync").wire_share() == 1.0 and cfg("ps-sync").key_mb() == 0.125
    topk = cfg("ps-sync", "compress.method=topk", "compress.ratio=0.01")
    assert topk.wire_share() == pytest.approx(0.02, rel=0.01) and topk.key_mb() == 4.0  # values and int32 indices
    assert cfg("ps-sync", "compress.method=qsgd").key_mb() == 0.25 and cfg("ps-sync", "compress.method=fp16").wire_share() == 0.5
    # Pulls of whole values (ps-async, compress.pull=false) carry the key's bytes: keys as uncompressed.
    for dense_pulls in (cfg("ps-async", "compress.method=topk"), cfg("ps-sync", "compress.method=topk", "compress.pull=false")):
        assert dense_pulls.wire_share() == 1.0 and dense_pulls.key_mb() == 0.125
    assert cfg("ps-sync", "compress.method=topk", "ps.chunk_mb=1").key_mb() == 1


def test_row_sparse_layout_refuses_torn_rows_and_flat_params():
    wire = build_layout(TABLES, 2, 1000, sparse=[0]).to_wire()
    first, second = wire["keys"][0], wire["keys"][1]
    first[3] -= 1  # key 0 one element shorter, key 1 starts one earlier
    second[2] -= 1
    second[3] += 1
    with pytest.raises(ValueError, match="whole rows"):
        Layout.from_wire(wire)
    with pytest.raises(ValueError, match="2-D"):
        build_layout(TABLES, 2, 1000, sparse=[1])


def test_split_and_join_values():
    params = [torch.randn(s.shape, dtype=getattr(torch, s.dtype)) for s in CNN]
    layout = build_layout(CNN, 3, 100)
    values = split_values(layout, params)
    assert sum(v.numel() for v in values.values()) == sum(p.numel() for p in params)
    assert set(split_values(layout, params, 1)) == {k.id for k in layout.shard_keys(1)}
    for p, q in zip(params, join_values(layout, values)):
        assert torch.equal(p, q)


def test_build_layout_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_shards"):
        build_layout(CNN, 0, 10)
    with pytest.raises(ValueError, match="chunk_elems"):
        build_layout(CNN, 2, 0)
    with pytest.raises(ValueError, match="dtype"):
        ParamSpec("x", (2,), "int8")


@pytest.mark.parametrize("field,value,message", [
    ("staleness", -1, "staleness"), ("staleness", 1.5, "staleness"), ("chunk_mb", -1, "chunk_mb"),
    ("timeout_s", math.inf, "timeout_s"), ("heartbeat_s", -1, "heartbeat_s"), ("on_worker_loss", "ignore", "drop"),
    ("async_scale", "median", "mean"), ("max_message_mb", True, "max_message_mb"), ("worker_timeout_s", 0.5, "heartbeat_s"),
])
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        PSConfig(**{field: value})


def test_config_defaults():
    cfg = PSConfig()
    assert (cfg.staleness, cfg.on_worker_loss, cfg.async_scale) == (2, "mode", "mean")
    assert cfg.max_message_bytes == 1024 << 20
    # No barrier to hold under async and ssp: a lost worker is dropped unless told otherwise.
    assert [cfg.loss_policy(m) for m in ("sync", "async", "ssp")] == ["abort", "drop", "drop"]
    assert PSConfig(on_worker_loss="drop").loss_policy("sync") == "drop"
    assert PSConfig(on_worker_loss="abort").loss_policy("async") == "abort"
    with pytest.raises(AttributeError):
        cfg.staleness = 3  # frozen


@pytest.mark.parametrize("chunk_mb,rate,expected", [
    (0, 200e6, 0.125), (0, 100e6, 0.125), (0, 1e9, 0.5), (0, 2e9, 1.0), (0, 10e9, 4.0), (0, 10e6, 0.125),
    (0, None, 4.0),
    (0.3, 200e6, 0.3), (1024, None, 1024),
])
def test_key_size_follows_the_link_unless_given(chunk_mb, rate, expected):
    """chunk_mb=0: what the link carries in 5 ms, as a power of two within 1/8 to 4 MiB."""
    assert key_mb(chunk_mb, rate) == expected
