"""Datasets built offline and deterministically, and engine-independent per-rank shards.

Every dataset is a pure function of its config (experiments/workloads/data.py) and a seed, so
each process of a run builds the same tensors, and rank r of N gets the same shard and
batches whatever the engine.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from experiments.workloads.vocab import VOCAB

TASK_NAMES = ("classify", "lm", "binary", "click")


@dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test splits as tensors whose first dimension indexes examples."""

    train: tuple[torch.Tensor, ...]
    """Model inputs of the training split, passed to the model as `model(*inputs)`."""
    train_targets: torch.Tensor
    """Targets of the training split."""
    test: tuple[torch.Tensor, ...]
    """Model inputs of the test split."""
    test_targets: torch.Tensor
    """Targets of the test split."""
    task: str
    """Which loss and metrics apply: one of TASK_NAMES."""

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise ValueError(f"task {self.task!r} is unknown; expected one of {TASK_NAMES}")
        for split, inputs, targets in (
            ("train", self.train, self.train_targets),
            ("test", self.test, self.test_targets),
        ):
            sizes = {len(t) for t in inputs} | {len(targets)}
            if len(sizes) != 1:
                raise ValueError(f"{split} tensors disagree on the number of examples: {sorted(sizes)}")

    @property
    def n_train(self) -> int:
        """Number of training examples."""
        return len(self.train_targets)

    @property
    def n_test(self) -> int:
        """Number of test examples."""
        return len(self.test_targets)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as (pixels float32 (N, 64) in 0..16, labels int64), from scikit-learn;
    the caller's own copies of what this process read once (a process that trains several runs
    one after another, a batch, parses the CSV once: 30 ms a run)."""
    pixels, labels = _digits_table()
    return pixels.copy(), labels.copy()


@functools.lru_cache(maxsize=1)
def _digits_table() -> tuple[np.ndarray, np.ndarray]:
    """Read straight from the CSV that scikit-learn ships, which is what its load_digits reads:
    importing scikit-learn itself costs each worker process over two seconds."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.exists():
        from sklearn.datasets import load_digits

        digits = load_digits()
        return np.asarray(digits.data, dtype=np.float32), np.asarray(digits.target, dtype=np.int64)
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    return table[:, :-1], table[:, -1].astype(np.int64)


def encode(text: str) -> torch.Tensor:
    """Token ids (int64) of text under the fixed VOCAB; characters outside it get id len(VOCAB)."""
    table = np.full(128, len(VOCAB), dtype=np.int64)
    table[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.full(len(codes), len(VOCAB), dtype=np.int64)
    ascii_ = codes < 128
    ids[ascii_] = table[codes[ascii_]]
    return torch.from_numpy(ids)


def decode(ids: torch.Tensor) -> str:
    """Text of token ids; the out-of-vocabulary id reads as U+FFFD."""
    return "".join(VOCAB[i] if i < len(VOCAB) else "\ufffd" for i in ids.tolist())


def stdlib_source_text(max_chars: int) -> str:
    """The .py files directly in the standard library directory, sorted by name, joined, cut to max_chars."""
    root = Path(os.__file__).parent
    # _sysconfigdata* is generated per build (paths, compiler flags), so it would make hosts disagree.
    files = sorted(
        (p for p in root.iterdir() if p.suffix == ".py" and p.is_file() and not p.name.startswith("_sysconfigdata")),
        key=lambda p: p.name,
    )
    parts, total = [], 0
    for path in files:
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
    return "".join(parts)[:max_chars]


def digits(cfg, seed: int) -> Dataset:
    """cfg: a data.DigitsConfig. The digits, split by a seeded permutation."""
    pixels, labels = load_digits_arrays()
    images = torch.from_numpy(pixels.reshape(-1, 8, 8) / np.float32(16.0)).unsqueeze(1)
    if cfg.size != 8:
        images = F.interpolate(images, size=(cfg.size, cfg.size), mode="bilinear", align_corners=False)
    targets = torch.from_numpy(labels)
    perm = torch.randperm(len(targets), generator=_generator(seed))
    n_test = max(1, round(len(targets) * cfg.test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset((images[train],), targets[train], (images[test],), targets[test], "classify")


def char_corpus(cfg, seed: int) -> Dataset:
    """cfg: a data.CharCorpusConfig. Windows of block_size + 1 characters; the last test_fraction of them held out."""
    # The seed is unused: the corpus and its split are fixed, and batches are shuffled by the feeder.
    ids = encode(stdlib_source_text(cfg.max_chars))
    span = cfg.block_size + 1
    n_windows = len(ids) // span
    if n_windows < cfg.MIN_WINDOWS:
        raise ValueError(
            f"the corpus has {len(ids)} characters, only {n_windows} windows of block_size+1={span}; "
            f"need at least {cfg.MIN_WINDOWS}: raise max_chars or lower block_size"
        )
    windows = ids[: n_windows * span].view(n_windows, span)
    n_test = min(n_windows - 1, max(1, round(n_windows * cfg.test_fraction)))
    train, test = windows[:-n_test], windows[-n_test:]
    # clone() so each split owns compact memory instead of views into the whole corpus.
    return Dataset(
        (train[:, :-1].clone(),), train[:, 1:].clone(), (test[:, :-1].clone(),), test[:, 1:].clone(), "lm"
    )


def sparse_features(cfg, seed: int) -> Dataset:
    """cfg: a data.SparseConfig. Sparse logistic regression with labels drawn from a planted model."""
    g = _generator(seed)
    w_true = torch.randn(cfg.features, generator=g)
    indices = torch.randint(0, cfg.features, (cfg.samples, cfg.nnz), generator=g)
    values = torch.randn(cfg.samples, cfg.nnz, generator=g).abs()
    u = torch.rand(cfg.samples, generator=g)
    logits = (values * w_true[indices]).sum(dim=1)
    # Labels are Bernoulli(sigmoid(x.w*)) draws, so even w* itself cannot fit them exactly.
    targets = (torch.sigmoid(logits) > u).to(torch.float32)
    n_test = min(cfg.samples - 1, max(1, round(cfg.samples * cfg.test_fraction)))
    cut = cfg.samples - n_test
    return Dataset(
        (indices[:cut], values[:cut]), targets[:cut], (indices[cut:], values[cut:]), targets[cut:], "binary"
    )


def clicks(cfg, seed: int) -> Dataset:
    """cfg: a data.ClickConfig. Click logs with Zipf ids and labels drawn from a planted model (ClickConfig)."""
    g = _generator(seed)
    n, latent = cfg.samples, 4
    dense = torch.randn(n, cfg.dense, generator=g)
    logit = dense @ (torch.randn(cfg.dense, generator=g) * 0.3)
    ids, vectors = [], []
    for rows in cfg.tables:
        column = zipf_ids(n, rows, cfg.zipf, g)
        ids.append(column)
        logit += torch.randn(rows, generator=g)[column] * 0.8  # each id's own effect
        vectors.append(torch.randn(rows, latent, generator=g)[column] / math.sqrt(latent))
    for a in range(len(vectors)):  # what a dot-product interaction can learn
        for b in range(a + 1, len(vectors)):
            logit += (vectors[a] * vectors[b]).sum(dim=1)
    targets = (torch.sigmoid(logit - 1.0) > torch.rand(n, generator=g)).to(torch.float32)
    ids = torch.stack(ids, dim=1)
    n_test = min(n - 1, max(1, round(n * cfg.test_fraction)))
    cut = n - n_test
    return Dataset((dense[:cut], ids[:cut]), targets[:cut], (dense[cut:], ids[cut:]), targets[cut:], "click")


def zipf_ids(n: int, rows: int, s: float, g: torch.Generator) -> torch.Tensor:
    """n ids in 0..rows-1, the k-th most frequent drawn with probability ~ 1/k**s; which id is
    the k-th most frequent is a seeded permutation, so hot ids are spread over the table."""
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-s)
    ranks = torch.multinomial(weights, n, replacement=True, generator=g)
    return torch.randperm(rows, generator=g)[ranks]


def shard_indices(n: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """Example indices of rank's shard: part `rank` of a seeded permutation of range(n) cut into
    `world` contiguous parts whose sizes differ by at most one. The parts are disjoint and cover range(n)."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}) for world={world}, got {rank}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    perm = torch.randperm(n, generator=_generator(seed))
    return torch.tensor_split(perm, world)[rank].clone()


def _mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same in every process (unlike hash() of a str)."""
    digest = hashlib.sha256(repr(tuple(int(p) for p in parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    # Token ids and feature indices must stay int64; only real-valued tensors follow the model dtype.
    return t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device=device)


class BatchFeeder:
    """Per-rank training batches as a pure function of (dataset, rank, world, batch_size, seed, step).

    The shard is reshuffled every epoch; the incomplete last batch of an epoch is dropped so that
    every step of every rank has exactly batch_size examples.
    """

    def __init__(
        self,
        dataset: Dataset,
        rank: int,
        world: int,
        batch_size: int,
        seed: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        idx = shard_indices(dataset.n_train, rank, world, seed)
        if len(idx) < batch_size:
            raise ValueError(
                f"rank {rank} of {world} has a shard of {len(idx)} examples, fewer than batch_size={batch_size}; "
                f"lower batch_size or the number of workers"
            )
        self.rank, self.world, self.batch_size, self.seed = rank, world, batch_size, seed
        self.shard_len = len(idx)
        self.batches_per_epoch = self.shard_len // batch_size
        # Gather and cast the shard once, so each batch is a single index_select per tensor.
        self._inputs = tuple(_cast(t[idx], dtype, device) for t in dataset.train)
        self._targets = _cast(dataset.train_targets[idx], dtype, device)
        self._device = device
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        self._last: tuple[int, tuple] | None = None  # (step, its batch): the latest one made

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = _generator(_mix_seed(self.seed, self.rank, epoch))
            self._perm = torch.randperm(self.shard_len, generator=g).to(self._device)
            self._epoch = epoch
        return self._perm

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """(inputs, targets) of this rank for global step `step` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if self._last is not None and self._last[0] == step:  # asked again (an engine's prefetch)
            return self._last[1]
        epoch, b = divmod(step, self.batches_per_epoch)
        sel = self._epoch_perm(epoch)[b * self.batch_size : (b + 1) * self.batch_size]
        self._last = (step, (tuple(t[sel] for t in self._inputs), self._targets[sel]))
        return self._last[1]


def test_batches(
    dataset: Dataset,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """The test split in order, in batches of batch_size; the last batch may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    for start in range(0, dataset.n_test, batch_size):
        end = start + batch_size
        inputs = tuple(_cast(t[start:end], dtype, device) for t in dataset.test)
        yield inputs, _cast(dataset.test_targets[start:end], dtype, device)


# pytest would otherwise collect this generator function as a test when a test module imports it.
test_batches.__test__ = False  # type: ignore[attr-defined]
