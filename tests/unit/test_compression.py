"""The compressor library (experiments.compression): table tests per method, messages that add
up (or not), error feedback's identity, QSGD's unbiasedness, PowerSGD's linearity, and the
settings it refuses. float64 wherever equality is claimed."""

from __future__ import annotations

import math
import re

import pytest
import torch

from experiments.compression import CompressConfig, Context, ErrorFeedback, sum_messages
from experiments.compression import bits
from experiments.compression.base import count
from experiments.compression.powersgd import PowerSGD, orthogonalize
from experiments.compression.randomk import indices as randomk_indices

F64 = torch.float64


def grad(*shape, seed=0, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def build(method, **kw):
    return CompressConfig(method=method, **kw).build()


# --- table tests: frames, nbytes against the formula, dtype, exactness -----------------------

# (method, settings, shape, expected nbytes as a function of n and element size e)
TABLE = [
    ("none", {}, (6, 5), lambda n, e: n * e),
    ("none", {}, (7,), lambda n, e: n * e),
    ("fp16", {}, (6, 5), lambda n, e: n * 2),
    ("bf16", {}, (3, 4, 5), lambda n, e: n * 2),
    ("topk", {"ratio": 0.1}, (6, 5), lambda n, e: 3 * (e + 4)),      # k = ceil(3.0) = 3
    ("topk", {"ratio": 0.25}, (9,), lambda n, e: 3 * (e + 4)),        # k = ceil(2.25) = 3
    ("topk", {"ratio": 1e-6}, (6, 5), lambda n, e: 1 * (e + 4)),      # k >= 1
    ("randomk", {"ratio": 0.1}, (6, 5), lambda n, e: 3 * e),          # indices not sent
    ("randomk", {"ratio": 0.5}, (3, 3), lambda n, e: 5 * e),
    ("sign", {}, (6, 5), lambda n, e: e + 4),                          # scale + ceil(30/8)
    ("sign", {}, (16,), lambda n, e: e + 2),
    ("sign", {}, (1,), lambda n, e: e + 1),
    ("qsgd", {"levels": 16}, (6, 5), lambda n, e: e + n * 1 + 4),     # norm (one bucket) + uint8 + bits
    ("qsgd", {"levels": 16}, (1100,), lambda n, e: 3 * e + n + 138),  # 3 buckets of 512
    ("qsgd", {"levels": 300}, (6, 5), lambda n, e: e + n * 2 + 4),    # int16 levels
    ("qsgd", {"levels": 40000}, (9,), lambda n, e: e + n * 4 + 2),    # int32 levels
]


@pytest.mark.parametrize("method,settings,shape,expected", TABLE)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_table(method, settings, shape, expected, dtype):
    c, _ = build(method, **settings)
    g = grad(*shape, dtype=dtype)
    m = c.compress(g, Context(step=3, key="w", rank=1))
    n, e = g.numel(), g.element_size()
    assert c.nbytes(m) == expected(n, e)
    assert m.shape == shape and m.dtype == dtype
    out = c.decompress(m)
    assert out.shape == g.shape and out.dtype == dtype
    if method == "none":
        assert torch.equal(out, g)
    elif method in ("fp16", "bf16"):
        eps = {"fp16": 2.0**-11, "bf16": 2.0**-8}[method]  # half an ulp, relative
        assert torch.all((out - g).abs() <= eps * g.abs())
    elif method in ("topk", "randomk"):
        sent = out != 0
        assert int(sent.sum()) == count(settings["ratio"], n)
        assert torch.equal(out[sent], g[sent])
        if method == "topk":  # the largest magnitudes are the ones sent
            assert g[sent].abs().min() >= g[~sent].abs().max()
    elif method == "sign":
        assert torch.equal(out, g.abs().mean() * torch.where(g >= 0, 1.0, -1.0).to(dtype))
    elif method == "qsgd":
        assert torch.equal(torch.sign(out[out != 0]), torch.sign(g[out != 0]))


@pytest.mark.parametrize("method", ["topk", "randomk"])
def test_ratio_one_is_exact(method):
    c, _ = build(method, ratio=1.0)
    g = grad(7, 11)
    assert torch.equal(c.decompress(c.compress(g, Context(step=2, key="k"))), g)


def test_count_rounds_ratio_times_n_before_ceil():
    assert [count(0.07, 100), count(0.01, 1000), count(0.3, 10), count(1e-9, 5), count(1.0, 7)] == \
        [7, 10, 3, 1, 7]


def test_topk_indices_are_int32():
    c, _ = build("topk", ratio=0.5)
    assert c.compress(grad(10), Context()).frames[1].dtype == torch.int32


def _same_as_topk(mag, k):
    """largest(mag, k) names k distinct entries whose values are the k largest, as torch.topk's."""
    from experiments.compression.topk import largest

    got = largest(mag, k)
    assert got.dtype == torch.int64 and got.numel() == k and got.unique().numel() == k
    torch.testing.assert_close(mag[got].sort().values, torch.topk(mag, k).values.sort().values,
                               rtol=0, atol=0, equal_nan=True)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,ratio", [(1000, 0.01), (20000, 0.01), (65536, 0.01), (401408, 0.01), (262144, 0.001),
                                     (200000, 0.1), (300000, 0.2)])
def test_topk_selects_what_torch_topk_selects(dtype, n, ratio):
    mag = grad(n, seed=n, dtype=dtype).abs()
    got = _same_as_topk(mag, count(ratio, n))
    if dtype != torch.float16:  # distinct values: the very same set
        assert set(got.tolist()) == set(torch.topk(mag, count(ratio, n)).indices.tolist())


def test_topk_selection_with_ties_nans_and_a_sample_that_overshoots():
    from experiments.compression import topk

    n = 1 << 20
    sparse = torch.zeros(n, dtype=F64)  # 0.5% nonzero, k = 1%: the k-th largest is a tie at 0
    sparse[torch.randperm(n, generator=torch.Generator().manual_seed(1))[: n // 200]] = 1.0
    _same_as_topk(sparse, n // 100)
    nans = grad(n, seed=2).abs()
    nans[::1000] = float("nan")  # torch.topk counts NaN largest: so does the selection
    got = _same_as_topk(nans, n // 100)
    assert int(torch.isnan(nans[got]).sum()) == len(range(0, n, 1000))
    # Every sampled entry large, k beyond the sample: the threshold overshoots the k-th largest.
    stride = topk.sample_stride(n)
    over = torch.ones(n, dtype=F64)
    over[::stride] = 10.0
    over[1::7] += torch.rand(len(range(1, n, 7)), dtype=F64, generator=torch.Generator().manual_seed(3))
    assert len(range(0, n, stride)) < n // 100
    _same_as_topk(over, n // 100)


def test_bits_pack_eight_per_byte_msb_first():
    b = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    packed = bits.pack(b)
    assert packed.tolist() == [0b10000001, 0b10000000]
    assert torch.equal(bits.unpack(packed, 9), b)


def test_sign_sends_zero_as_plus():
    c, _ = build("sign")
    g = torch.tensor([0.0, -2.0, 1.0], dtype=F64)
    assert c.decompress(c.compress(g, Context())).tolist() == [1.0, -1.0, 1.0]


# --- adds up ---------------------------------------------------------------------------------

WORKERS = 4


@pytest.mark.parametrize("method,settings,tol", [
    ("none", {}, 0.0), ("randomk", {"ratio": 0.3}, 0.0),
    ("fp16", {}, 4 * 2.0**-11), ("bf16", {}, 4 * 2.0**-8)])
def test_messages_that_add_up(method, settings, tol):
    c, _ = build(method, **settings)
    assert c.adds_up
    grads = [grad(5, 6, seed=w) for w in range(WORKERS)]
    msgs = [c.compress(g, Context(step=4, key="layer.weight", rank=w)) for w, g in enumerate(grads)]
    summed = c.decompress(sum_messages(c, msgs))
    separate = sum(c.decompress(m) for m in msgs)
    scale = sum(g.abs() for g in grads)
    assert torch.all((summed - separate).abs() <= tol * scale)
    if method == "randomk":  # every worker drew the same indices: only the seed is shared
        assert len({m.header for m in msgs}) == 1
        seed, k = msgs[0].header
        assert torch.equal((summed.reshape(-1) != 0).nonzero().view(-1), randomk_indices(seed, 30, k))
        assert torch.equal(summed, c.decompress(c.compress(sum(grads), Context(4, "layer.weight"))))


def test_randomk_indices_change_with_step_and_key():
    c, _ = build("randomk", ratio=0.2)
    g = grad(50)
    headers = {c.compress(g, Context(step, key)).header for step in (0, 1) for key in ("a", "b")}
    assert len(headers) == 4


def test_topk_messages_do_not_add_up():
    """Each worker keeps its own largest entries: the index frames differ, so a frame-wise sum
    is meaningless, and the sum of the decompressed messages (2k entries) is not the top-k
    message of the sum."""
    c, _ = build("topk", ratio=0.5)
    assert not c.adds_up
    a = torch.tensor([3.0, 0.0, 2.0, 0.0], dtype=F64)
    b = torch.tensor([0.0, 3.0, 0.0, 2.0], dtype=F64)
    ma, mb = c.compress(a, Context()), c.compress(b, Context())
    assert set(ma.frames[1].tolist()) != set(mb.frames[1].tolist())
    separate = c.decompress(ma) + c.decompress(mb)
    assert separate.tolist() == [3.0, 3.0, 2.0, 2.0]
    assert c.decompress(c.compress(a + b, Context())).tolist() == [3.0, 3.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="do not add up"):
        sum_messages(c, [ma, mb])


@pytest.mark.parametrize("method", ["sign", "qsgd"])
def test_quantizers_do_not_claim_to_add_up(method):
    assert not build(method)[0].adds_up


def test_powersgd_projections_add_up():
    """P and Q are linear in M for the shared Q (and P): the sum of the workers' projections is
    the projection of their sum, so a ring all-reduces them."""
    c = PowerSGD(rank=2, start_step=0, seed=3)
    ms = [grad(8, 6, seed=w) for w in range(WORKERS)]
    ctx = Context(step=0, key="w")
    ps = [c.project(m, ctx) for m in ms]
    assert torch.allclose(sum(ps), c.project(sum(ms), ctx), rtol=0, atol=1e-12)
    p_sum = sum(ps)
    qs = [c.finish(m, p_sum, ctx)[1] for m in ms]
    p, q_of_sum = c.finish(sum(ms), p_sum, ctx)
    assert torch.allclose(sum(qs), q_of_sum, rtol=0, atol=1e-12)
    assert torch.allclose(p.t() @ p, torch.eye(2, dtype=F64), atol=1e-12)


# --- error feedback --------------------------------------------------------------------------

@pytest.mark.parametrize("method,settings", [
    ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1}), ("sign", {}),
    ("qsgd", {"levels": 4, "error_feedback": True}), ("fp16", {"error_feedback": True})])
def test_error_feedback_identity(method, settings):
    c, memory = build(method, **settings)
    assert isinstance(memory, ErrorFeedback)
    total_grad, total_sent = torch.zeros(4, 9, dtype=F64), torch.zeros(4, 9, dtype=F64)
    for step in range(20):
        g = grad(4, 9, seed=100 + step)
        compensated = memory.compensate("w", g)
        sent = c.decompress(c.compress(compensated, Context(step, "w", rank=1)))
        memory.remember("w", compensated, sent)
        total_grad += g
        total_sent += sent
    assert torch.allclose(total_sent + memory.residual("w"), total_grad, rtol=0, atol=1e-12)
    assert memory.residual("w").abs().max() > 0  # something was left out along the way


def test_error_feedback_defaults():
    assert {m: build(m)[1] is not None for m in
            ("none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "powersgd")} == \
        {"none": False, "fp16": False, "bf16": False, "topk": True, "randomk": True,
         "sign": True, "qsgd": False, "powersgd": True}
    assert build("topk", error_feedback=False)[1] is None
    assert build("bf16", error_feedback=True)[1] is not None


# --- QSGD ------------------------------------------------------------------------------------

def test_qsgd_takes_a_norm_per_bucket_of_512():
    c, _ = build("qsgd", levels=4)
    g = grad(1100)
    g[:512] *= 1000  # a loud first bucket must not drown the others' levels
    m = c.compress(g, Context())
    norms = m.frames[0]
    assert norms.shape == (3,) and torch.allclose(norms, torch.stack([g[:512].norm(), g[512:1024].norm(),
                                                                       g[1024:].norm()]))
    assert m.frames[1][512:].double().mean() > 0.05  # ~4 * 0.8 / sqrt(512); one norm of all: ~1e-4

def test_qsgd_is_unbiased_and_bounded():
    c, _ = build("qsgd", levels=2)
    g = grad(40, seed=7)
    draws = torch.stack([c.decompress(c.compress(g, Context(step, "w", rank=0)))
                         for step in range(2000)])
    norm = g.norm()
    assert torch.all(draws.abs() <= norm * (1 + 1e-12))
    # each entry's draw has std <= norm / (2 * levels); its mean over 2000 within 5 sigma
    assert (draws.mean(0) - g).abs().max() < 5 * norm / 4 / math.sqrt(2000)
    assert len({tuple(d.tolist()) for d in draws[:20]}) > 1  # the draws do differ by step


def test_qsgd_rounding_differs_per_rank():
    c, _ = build("qsgd", levels=1)
    g = grad(64)
    a, b = (c.compress(g, Context(1, "w", rank=r)).frames[1] for r in (0, 1))
    assert not torch.equal(a, b)


# --- PowerSGD --------------------------------------------------------------------------------

def test_powersgd_what_it_compresses():
    c = PowerSGD(rank=2, start_step=3)
    assert not c.compresses((64, 64), 2)          # before start_step
    assert c.compresses((64, 64), 3)
    assert not c.compresses((64,), 3)             # vectors: never
    assert not c.compresses((8, 4), 3)            # (8 + 4) * 2 * 2 = 48 >= 32: no saving
    assert c.compresses((16, 3, 3, 3), 3)         # conv weight as a 16 x 27 matrix: 172 < 432
    assert c.compressed_nbytes((16, 3, 3, 3), F64) == (16 + 27) * 2 * 8
    with pytest.raises(ValueError, match="project/finish/reconstruct"):
        c.compress(grad(64, 64), Context(step=3, key="w"))
    dense = c.compress(grad(64), Context(step=3))
    assert c.nbytes(dense) == 64 * 8


def test_powersgd_is_exact_on_a_low_rank_matrix():
    """A rank-1 gradient shared by both workers is reconstructed exactly by rank-1 PowerSGD."""
    c = PowerSGD(rank=1, start_step=0)
    m = torch.outer(grad(12, seed=1), grad(10, seed=2))
    ctx = Context(0, "w")
    p_sum = 2 * c.project(m, ctx)
    p, q = c.finish(m, p_sum, ctx)
    out = c.reconstruct(p, (q + q) / 2, ctx, (12, 10))
    assert torch.allclose(out, m, rtol=0, atol=1e-12)
    assert torch.equal(c.q["w"], q)  # warm start keeps Q_mean


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_orthogonalize(rank):
    p = grad(9, rank)
    orthogonalize(p)
    assert torch.allclose(p.t() @ p, torch.eye(rank, dtype=F64), atol=1e-12)
    zero = torch.zeros(5, 1, dtype=F64)
    orthogonalize(zero)
    assert torch.equal(zero, torch.zeros(5, 1, dtype=F64))  # torch would give NaN


# --- settings refused ------------------------------------------------------------------------

@pytest.mark.parametrize("settings,named", [
    ({"method": "zip"}, "compress.method='zip'"),
    ({"method": "topk", "ratio": 0.0}, "compress.ratio=0.0"),
    ({"method": "topk", "ratio": 1.5}, "compress.ratio=1.5"),
    ({"method": "randomk", "ratio": -0.1}, "compress.ratio=-0.1"),
    ({"method": "powersgd", "rank": 0}, "compress.rank=0"),
    ({"method": "qsgd", "levels": 0}, "compress.levels=0"),
    ({"method": "powersgd", "start_step": -1}, "compress.start_step=-1"),
    ({"method": "qsgd", "ratio": 0.5}, "compress.ratio=0.5"),
    ({"method": "topk", "levels": 4}, "compress.levels=4"),
    ({"method": "fp16", "rank": 2}, "compress.rank=2"),
    ({"method": "sign", "seed": 1}, "compress.seed=1"),
    ({"method": "none", "error_feedback": True}, "compress.error_feedback=True"),
])
def test_bad_settings_are_refused_in_one_line(settings, named):
    with pytest.raises(ValueError) as info:
        CompressConfig(**settings).check()  # the settings a method does not read: by check()
    message = str(info.value)
    assert message.startswith(named) and "\n" not in message


def test_every_setting_has_a_docstring_and_good_settings_build():
    import ast
    import inspect

    from experiments.compression import config

    tree = ast.parse(inspect.getsource(config.CompressConfig))
    body = tree.body[0].body
    documented = {body[i].target.id for i in range(len(body) - 1)
                  if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)}
    assert documented == {"method", "ratio", "levels", "rank", "start_step", "error_feedback", "seed", "pull"}
    for settings in ({"method": "qsgd", "levels": 4, "seed": 2}, {"method": "randomk", "ratio": 1.0},
                     {"method": "powersgd", "rank": 4, "start_step": 0, "error_feedback": False}):
        compressor, _ = CompressConfig(**settings).build()
        assert compressor.name == settings["method"]


# --- what a receiver checks of a peer's message (the parameter server's shards) -------------

@pytest.mark.parametrize("method,settings,shape,expected", [t for t in TABLE])
def test_forms_describe_the_frames(method, settings, shape, expected):
    c, _ = build(method, **settings)
    m = c.compress(grad(*shape, dtype=torch.float32), Context(step=2, key="w", rank=0))
    assert c.forms(shape, torch.float32, m.header) == [(f.dtype, tuple(f.shape)) for f in m.frames]
    c.check(m)


@pytest.mark.parametrize("method,settings,header,needle", [
    ("topk", {"ratio": 0.1}, (3,), "expected []"),
    ("randomk", {"ratio": 0.1}, (5, 4), "k=3"),
    ("randomk", {"ratio": 0.1}, (5,), "expected 2 ints"),
    ("randomk", {"ratio": 0.1}, (-1, 3), "index seed"),
    ("qsgd", {"levels": 16}, (8,), "expected [16]"),
    ("sign", {}, (1, 2), "expected []"),
])
def test_forms_refuse_a_header_the_method_never_sends(method, settings, header, needle):
    c, _ = build(method, **settings)
    with pytest.raises(ValueError, match=re.escape(needle)):
        c.forms((6, 5), torch.float32, header)


def test_check_refuses_indices_and_levels_out_of_range():
    topk, _ = build("topk", ratio=0.1)
    m = topk.compress(grad(6, 5), Context())
    bad = type(m)((m.frames[0], torch.tensor([0, 1, 30], dtype=torch.int32)), m.shape, m.dtype)
    with pytest.raises(ValueError, match=r"topk: indices must lie in 0\.\.29"):
        topk.check(bad)
    qsgd, _ = build("qsgd", levels=4)
    m = qsgd.compress(grad(6, 5), Context())
    levels = m.frames[1].clone()
    levels[3] = 5
    with pytest.raises(ValueError, match=r"qsgd: levels must lie in 0\.\.4"):
        qsgd.check(type(m)((m.frames[0], levels, m.frames[2]), m.shape, m.dtype, m.header))
