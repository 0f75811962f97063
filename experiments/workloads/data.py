"""What a run trains on: the datasets' configs, built offline and deterministically by
experiments/workloads/datasets.py (imported when one is built: reading a config imports no
torch), which also cuts the engine-independent per-rank shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiments.workloads.datasets import Dataset


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")


@dataclass(frozen=True)
class DigitsConfig:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images), optionally upsampled."""

    size: int = 8
    """Image side in pixels; 8 is the original, larger sizes (28 for the CNN) are bilinear upsamples."""
    test_fraction: float = 0.2
    """Share of the images held out for evaluation."""

    def __post_init__(self) -> None:
        if self.size < 8:
            raise ValueError(f"size must be at least 8 (the digits are 8x8), got {self.size}")
        _check_fraction("test_fraction", self.test_fraction)

    def build(self, seed: int) -> Dataset:
        from experiments.workloads import datasets
        return datasets.digits(self, seed)



@dataclass(frozen=True)
class CharCorpusConfig:
    """Character-level language modelling on the Python standard library's own source (offline)."""

    block_size: int = 64
    """Context length T: each example is T input ids and the T ids that follow them."""
    max_chars: int = 300_000
    """Characters of source read, in file-name order."""
    test_fraction: float = 0.1
    """Share of the windows, taken from the end of the corpus, held out for evaluation."""

    MIN_WINDOWS = 4  # class constant, not a field: fewer cannot give both splits a window

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_chars < 1:
            raise ValueError(f"max_chars must be positive, got {self.max_chars}")
        _check_fraction("test_fraction", self.test_fraction)

    def build(self, seed: int) -> Dataset:
        from experiments.workloads import datasets
        return datasets.char_corpus(self, seed)



@dataclass(frozen=True)
class SparseConfig:
    """Synthetic sparse logistic regression, the setting of the Hogwild! paper."""

    samples: int = 20_000
    """Number of examples, train and test together."""
    features: int = 2**15
    """Dimension of the (sparse) feature space."""
    nnz: int = 16
    """Features touched by each example, drawn uniformly with replacement (repeats just add)."""
    test_fraction: float = 0.2
    """Share of the examples held out for evaluation."""

    def __post_init__(self) -> None:
        for name in ("samples", "features", "nnz"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.samples < 2:
            raise ValueError(f"samples must be at least 2 to give both splits an example, got {self.samples}")
        _check_fraction("test_fraction", self.test_fraction)

    def build(self, seed: int) -> Dataset:
        from experiments.workloads import datasets
        return datasets.sparse_features(self, seed)



@dataclass(frozen=True)
class ClickConfig:
    """Synthetic click logs in the DLRM setting: dense features plus one id per embedding
    table, the ids Zipf-distributed (a few rows are hot, most are rarely touched), and labels
    drawn from a planted model (per-id effects, pairwise latent interactions between tables,
    a linear term in the dense features), so that the loss can really fall."""

    samples: int = 200_000
    """Number of examples, train and test together."""
    dense: int = 13
    """Dense features per example (Criteo's count)."""
    tables: tuple[int, ...] = (2**18, 2**18, 2**18, 2**18)
    """Rows of each embedding table; an example holds one id in each."""
    zipf: float = 1.1
    """Skew s of the ids: P(the k-th most frequent id) is proportional to 1/k**s (0: uniform)."""
    test_fraction: float = 0.1
    """Share of the examples held out for evaluation."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))  # JSON gives a list
        for name in ("samples", "dense"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.tables or any(type(r) is not int or r < 2 for r in self.tables):
            raise ValueError(f"tables must be row counts >= 2, got {self.tables}")
        if self.zipf < 0:
            raise ValueError(f"zipf must be >= 0, got {self.zipf}")
        _check_fraction("test_fraction", self.test_fraction)

    def build(self, seed: int) -> Dataset:
        from experiments.workloads import datasets
        return datasets.clicks(self, seed)
