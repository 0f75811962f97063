"""Named experiments: plain functions that return a RunConfig."""

from __future__ import annotations

from typing import Callable

from experiments.settings.config import OptimConfig, RunConfig, resolve
from experiments.workloads.data import CharCorpusConfig, ClickConfig, DigitsConfig, SparseConfig
from experiments.workloads.models import CNNConfig, DLRMConfig, GPTConfig, LogRegConfig, MLPConfig


def quickstart() -> RunConfig:
    """MLP 64-128-10 on scikit-learn's 8x8 digits: a whole comparison in under a minute."""
    return RunConfig(experiment="quickstart", model=MLPConfig(64, (128,), 10),
                     data=DigitsConfig(size=8), steps=150, batch_size=32, target_loss=0.15,
                     optim=OptimConfig("sgd", lr=0.1, momentum=0.9))


def mlp_wide() -> RunConfig:
    """784-4096-4096-10 (about 20 M parameters, 80 MB of float32 gradients per step): the
    communication-bound case."""
    return RunConfig(experiment="mlp-wide", model=MLPConfig(784, (4096, 4096), 10),
                     data=DigitsConfig(size=28), steps=30, batch_size=64, target_loss=0.8,
                     optim=OptimConfig("sgd", lr=0.05, momentum=0.9))


def mlp_mid() -> RunConfig:
    """784-2048-2048-10 (5.8 M parameters, 23 MB of float32 gradients per step): link-bound on
    a few hundred Mbit/s while its compute stays small on 2 cores (--net comparisons)."""
    return RunConfig(experiment="mlp-mid", model=MLPConfig(784, (2048, 2048), 10),
                     data=DigitsConfig(size=28), steps=30, batch_size=64, target_loss=0.8,
                     optim=OptimConfig("sgd", lr=0.05, momentum=0.9))


def cnn() -> RunConfig:
    """Two conv layers with BatchNorm on digits upsampled to 28x28; BatchNorm statistics
    follow rank 0 (broadcast every step), its batch statistics stay per worker."""
    return RunConfig(experiment="cnn", model=CNNConfig(), data=DigitsConfig(size=28),
                     steps=100, batch_size=32, target_loss=0.15,
                     optim=OptimConfig("sgd", lr=0.02, momentum=0.9))


def gpt_char() -> RunConfig:
    """A 2-block pre-norm character transformer on the Python standard library's own source."""
    return RunConfig(experiment="gpt-char", model=GPTConfig(), data=CharCorpusConfig(),
                     steps=200, batch_size=16, target_loss=2.0, optim=OptimConfig("adamw", lr=1e-3))


def logreg_sparse() -> RunConfig:
    """Logistic regression on 8192 sparse features, 16 per example: Hogwild!'s setting, where
    lock-free updates rarely collide."""
    return RunConfig(experiment="logreg-sparse", model=LogRegConfig(2**13),
                     data=SparseConfig(samples=100_000, features=2**13), steps=400,
                     batch_size=32, target_loss=0.55, optim=OptimConfig("sgd", lr=5.0))


def dlrm() -> RunConfig:
    """DLRM-style click model: 4 embedding tables of 2^18 rows (dim 16, 67 MB), bottom and top
    MLPs, on generated clicks with Zipf-skewed ids; Adagrad, whose sparse update is its dense
    one. Smaller tables: --set model.tables=[4096,4096] --set data.tables=[4096,4096]."""
    return RunConfig(experiment="dlrm", model=DLRMConfig(), data=ClickConfig(), steps=300,
                     batch_size=128, target_loss=0.525, optim=OptimConfig("adagrad", lr=0.05))


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "quickstart": quickstart,
    "mlp-wide": mlp_wide,
    "mlp-mid": mlp_mid,
    "cnn": cnn,
    "gpt-char": gpt_char,
    "logreg-sparse": logreg_sparse,
    "dlrm": dlrm,
}


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown experiment {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]()


def describe(name: str) -> str:
    doc = " ".join((PRESETS[name].__doc__ or "").split())
    cfg = PRESETS[name]()
    return f"{doc} [{cfg.steps} steps, target loss {cfg.target_loss:g}]"


def build_config(experiment: str, overrides=(), **fields) -> RunConfig:
    """The preset, then CLI fields (engine, workers, ...), then `--set` overrides, strictly."""
    return resolve(get_preset(experiment), overrides, **fields)
