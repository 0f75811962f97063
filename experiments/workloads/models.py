"""Reference models, each made by a frozen config's build() (the networks themselves are in
experiments/workloads/networks.py, imported when one is built: reading a config imports no torch).

build() returns float32 parameters on the CPU; the caller converts dtype and device. Every
forward takes the data's inputs positionally (`model(*inputs)`) and returns logits, and every
parameter gets a gradient on every step, so engines never wait on a gradient that never comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from experiments.workloads.vocab import VOCAB_SIZE

if TYPE_CHECKING:
    from torch import nn


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be positive, got {value}")


@dataclass(frozen=True)
class MLPConfig:
    """Flatten, then Linear/ReLU layers, then a Linear to the classes."""

    inputs: int = 64
    """Input features after flattening (64 for 8x8 images, 784 for 28x28)."""
    hidden: tuple[int, ...] = (128,)
    """Widths of the hidden layers, in order; empty gives a linear classifier."""
    classes: int = 10
    """Number of output logits."""

    def __post_init__(self) -> None:
        # A config read back from JSON carries a list; keep the field hashable.
        object.__setattr__(self, "hidden", tuple(self.hidden))
        _check_positive(self, "inputs", "classes")
        if any(h < 1 for h in self.hidden):
            raise ValueError(f"MLPConfig.hidden widths must all be positive, got {self.hidden}")

    def build(self) -> nn.Module:
        from experiments.workloads import networks
        return networks.mlp(self)


@dataclass(frozen=True)
class CNNConfig:
    """Two conv/batch-norm/ReLU/max-pool stages and a Linear, on (B, 1, 28, 28) images."""

    classes: int = 10
    """Number of output logits."""

    def __post_init__(self) -> None:
        _check_positive(self, "classes")

    def build(self) -> nn.Module:
        from experiments.workloads import networks
        return networks.cnn(self)


@dataclass(frozen=True)
class GPTConfig:
    """A nanoGPT-style character transformer with pre-norm blocks."""

    vocab_size: int = VOCAB_SIZE
    """Number of token ids (the data's fixed character vocabulary by default)."""
    block_size: int = 64
    """Longest sequence the learned position embedding covers."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention and residual branches (0 keeps runs deterministic)."""

    def __post_init__(self) -> None:
        _check_positive(self, "vocab_size", "block_size", "n_layer", "n_head", "n_embd")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                f"choose n_embd a multiple of n_head (e.g. {self.n_head * max(1, self.n_embd // self.n_head)})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def build(self) -> nn.Module:
        from experiments.workloads import networks
        return networks.GPT(self)


@dataclass(frozen=True)
class LogRegConfig:
    """Logistic regression on sparse (indices, values) features, as in the Hogwild! paper."""

    features: int = 2**15
    """Dimension of the sparse feature space."""

    def __post_init__(self) -> None:
        _check_positive(self, "features")

    def build(self) -> nn.Module:
        from experiments.workloads import networks
        return networks.SparseLogReg(self.features)


@dataclass(frozen=True)
class DLRMConfig:
    """DLRM (Naumov et al., 2019): a bottom MLP over the dense features, one embedding table
    per sparse feature, pairwise dot products between all of them, a top MLP to one logit."""

    dense: int = 13
    """Dense input features (the data's `dense`)."""
    tables: tuple[int, ...] = (2**18, 2**18, 2**18, 2**18)
    """Rows of each embedding table (the data's `tables`)."""
    dim: int = 16
    """Embedding width; the bottom MLP ends at this width too."""
    bottom: tuple[int, ...] = (64,)
    """Hidden widths of the bottom MLP."""
    top: tuple[int, ...] = (64,)
    """Hidden widths of the top MLP."""

    def __post_init__(self) -> None:
        for name in ("tables", "bottom", "top"):
            object.__setattr__(self, name, tuple(getattr(self, name)))  # JSON gives lists
        _check_positive(self, "dense", "dim")
        if not self.tables or any(r < 1 for r in self.tables):
            raise ValueError(f"DLRMConfig.tables must be positive row counts, got {self.tables}")

    def check_data(self, data: object) -> None:
        """The data must have the features this model reads."""
        for name in ("dense", "tables"):
            if getattr(data, name, None) != getattr(self, name):
                raise ValueError(f"model.{name}={getattr(self, name)} but data.{name}={getattr(data, name, None)}: "
                                 f"set both (--set model.{name}=... --set data.{name}=...)")

    def build(self) -> nn.Module:
        from experiments.workloads import networks
        return networks.DLRM(self)
