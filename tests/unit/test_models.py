import math

import pytest
import torch

from experiments.workloads.data import CharCorpusConfig, DigitsConfig, SparseConfig
from experiments.workloads.vocab import VOCAB_SIZE
from experiments.workloads.datasets import BatchFeeder
from experiments.workloads.models import CNNConfig, GPTConfig, LogRegConfig, MLPConfig
from experiments.workloads.tasks import get_task


def _images(side):
    return lambda B: ((torch.rand(B, 1, side, side),), torch.randint(0, 10, (B,)))


def _chars(B):
    return (torch.randint(0, VOCAB_SIZE, (B, 12)),), torch.randint(0, VOCAB_SIZE, (B, 12))


def _sparse(B):
    return (torch.randint(0, 100, (B, 5)), torch.rand(B, 5)), torch.randint(0, 2, (B,)).float()


# (config, task, batch maker, output shape for batch 3)
CASES = {
    "quickstart": (MLPConfig(), "classify", _images(8), (3, 10)),
    "mlp-deep": (MLPConfig(inputs=64, hidden=(32, 16), classes=5), "classify", _images(8), (3, 5)),
    "cnn": (CNNConfig(), "classify", _images(28), (3, 10)),
    "gpt": (GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16), "lm", _chars, (3, 12, VOCAB_SIZE)),
    "logreg": (LogRegConfig(features=100), "binary", _sparse, (3,)),
}


def _cast(t, dtype):
    return t.to(dtype) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_shape_and_every_parameter_gets_grad(name, dtype):
    config, task, make, shape = CASES[name]
    torch.manual_seed(0)
    model = config.build().to(dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    inputs, targets = make(3)
    inputs, targets = tuple(_cast(x, dtype) for x in inputs), _cast(targets, dtype)
    out = model(*inputs)
    assert out.shape == shape and out.dtype == dtype
    get_task(task).loss(out, targets).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    assert all(not p.grad.is_sparse for p in model.parameters())


def test_build_gives_float32():
    for config, *_ in CASES.values():
        assert all(p.dtype == torch.float32 for p in config.build().parameters())


@pytest.mark.parametrize(
    "config, expected",
    [
        (CNNConfig(), (16 * 25 + 16) + 2 * 16 + (32 * 16 * 25 + 32) + 2 * 32 + (7 * 7 * 32 * 10 + 10)),
        (MLPConfig(inputs=784, hidden=(4096, 4096)), 784 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10),
        (MLPConfig(), 64 * 128 + 128 + 128 * 10 + 10),
        (LogRegConfig(features=2**15), 2**15 + 1),
    ],
    ids=["cnn", "mlp-wide", "quickstart", "logreg"],
)
def test_parameter_counts(config, expected):
    assert sum(p.numel() for p in config.build().parameters()) == expected


def test_gpt_parameters_are_distinct_tensors():
    model = GPTConfig(n_embd=16, n_head=2).build()
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(ptrs) == len(set(ptrs))


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16).build().double()
    x = torch.randint(0, VOCAB_SIZE, (1, 8))
    y = x.clone()
    y[0, 5] = (x[0, 5] + 1) % VOCAB_SIZE
    assert torch.equal(model(x)[0, :5], model(y)[0, :5])  # earlier positions never see later tokens


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GPTConfig(n_embd=130, n_head=4), "n_embd=130 is not divisible by n_head=4"),
        (lambda: GPTConfig(n_layer=0), "n_layer"),
        (lambda: MLPConfig(hidden=(0,)), "hidden"),
        (lambda: LogRegConfig(features=0), "features"),
    ],
)
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make().build()


def test_gpt_rejects_too_long_sequence():
    model = GPTConfig(block_size=4, n_embd=16, n_head=2).build()
    with pytest.raises(ValueError, match="block_size=4"):
        model(torch.zeros(1, 5, dtype=torch.int64))


def test_quickstart_learns_digits():
    torch.manual_seed(0)
    data = DigitsConfig().build(seed=0)
    model, task = MLPConfig().build(), get_task("classify")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    feeder = BatchFeeder(data, rank=0, world=1, batch_size=32, seed=0)
    for step in range(200):
        inputs, targets = feeder.batch(step)
        opt.zero_grad()
        task.loss(model(*inputs), targets).backward()
        opt.step()
    model.train()
    metrics = task.evaluate(model, data, batch_size=100, dtype=torch.float32, device="cpu")
    assert model.training  # evaluate restores the mode it found
    assert set(metrics) == {"loss", "accuracy"}
    assert metrics["accuracy"] > 0.85, metrics


@pytest.mark.parametrize(
    "config, data",
    [
        (MLPConfig(), DigitsConfig()),
        (GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16), CharCorpusConfig(block_size=16, max_chars=4_000)),
        (LogRegConfig(features=100), SparseConfig(samples=300, features=100, nnz=4)),
    ],
    ids=["classify", "lm", "binary"],
)
def test_evaluate_weights_batches_by_size(config, data):
    torch.manual_seed(0)
    model, dataset = config.build().double(), data.build(seed=0)
    task = get_task(dataset.task)
    model.eval()
    whole = task.evaluate(model, dataset, batch_size=dataset.n_test, dtype=torch.float64)
    ragged = task.evaluate(model, dataset, batch_size=7, dtype=torch.float64)  # last batch is short
    assert not model.training
    expected = {"loss", "bits_per_char"} if dataset.task == "lm" else {"loss", "accuracy"}
    assert whole.keys() == ragged.keys() == expected
    for key in whole:
        assert ragged[key] == pytest.approx(whole[key], rel=1e-12)


class _Uniform(torch.nn.Module):
    def forward(self, idx):
        return torch.zeros(*idx.shape, VOCAB_SIZE)


def test_lm_bits_per_char_of_uniform_model():
    dataset = CharCorpusConfig(block_size=8, max_chars=1_000).build(seed=0)
    metrics = get_task("lm").evaluate(_Uniform(), dataset, batch_size=4)
    assert metrics["bits_per_char"] == pytest.approx(math.log2(VOCAB_SIZE), rel=1e-6)


def test_get_task_unknown_names_known():
    with pytest.raises(ValueError, match=r"'regress'.*\['binary', 'classify', 'click', 'lm'\]"):
        get_task("regress")


def test_dlrm_reads_dense_features_and_one_id_per_table():
    from experiments.workloads.models import DLRMConfig

    cfg = DLRMConfig(dense=5, tables=(50, 70, 90), dim=8, bottom=(16,), top=(16,))
    model = cfg.build()
    dense, ids = torch.randn(6, 5), torch.stack([torch.randint(0, r, (6,)) for r in cfg.tables], dim=1)
    out = model(dense, ids)
    assert out.shape == (6,)
    out.sum().backward()
    touched = ids[:, 1].unique()
    grad = model.tables[1].weight.grad
    assert grad[touched].abs().sum() > 0
    untouched = torch.ones(70, dtype=torch.bool)
    untouched[touched] = False
    assert grad[untouched].abs().sum() == 0  # rows no example used get zeros: a sparse update's rows
    with pytest.raises(ValueError, match="3 tables but the batch has 2"):
        model(dense, ids[:, :2])


def test_click_data_is_skewed_and_learnable_and_auc_is_mann_whitney():
    from experiments.workloads.data import ClickConfig
    from experiments.workloads.tasks import auc

    data = ClickConfig(samples=20_000, dense=3, tables=(1000, 1000), zipf=1.1).build(0)
    ids = data.train[1][:, 0]
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.25 * len(ids)  # a few hot rows, as in click logs
    assert 0.2 < data.train_targets.mean() < 0.8
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 0.75
    assert auc(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 1.0])) == 0.5  # ties count half
    assert ClickConfig(samples=500, tables=(64,)).build(3).test[1].max() < 64


def test_dlrm_model_and_data_must_agree():
    from experiments.settings.overrides import OverrideError
    from experiments.settings.presets import build_config

    with pytest.raises(OverrideError, match="model.tables=.*but data.tables="):
        build_config("dlrm", ["model.tables=[10,10]"])
    cfg = build_config("dlrm", ["model.tables=[10,10]", "data.tables=[10,10]"])
    assert cfg.model.tables == cfg.data.tables == (10, 10)
