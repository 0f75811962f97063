"""Losses and evaluation metrics per task kind ("classify", "lm", "binary")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from experiments.workloads.datasets import Dataset, test_batches


class Task:
    """A training loss plus an evaluation over a dataset's test split."""

    name = ""

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch, a scalar tensor."""
        raise NotImplementedError

    def _correct(self, output: torch.Tensor, targets: torch.Tensor) -> int:
        """Number of correct predictions in a batch."""
        raise NotImplementedError

    def _metrics(self, loss: float, correct: int, count: int) -> dict[str, float]:
        return {"loss": loss, "accuracy": correct / count}

    def evaluate(
        self,
        model: nn.Module,
        dataset: Dataset,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> dict[str, float]:
        """Metrics over the whole test split in eval mode; the model's training mode is restored after."""
        if dataset.n_test == 0:
            raise ValueError("the dataset has no test examples to evaluate on")
        was_training = model.training
        model.eval()
        total_loss, correct, count = 0.0, 0, 0
        try:
            with torch.no_grad():
                for inputs, targets in test_batches(dataset, batch_size, dtype, device):
                    output = model(*inputs)
                    # Weight by elements (examples, or tokens for lm) so a short last batch counts fairly.
                    n = targets.numel()
                    total_loss += self.loss(output, targets).item() * n
                    correct += self._correct(output, targets)
                    count += n
        finally:
            model.train(was_training)
        return self._metrics(total_loss / count, correct, count)


class Classify(Task):
    """Multi-class classification: logits (B, C), int64 targets (B,)."""

    name = "classify"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, targets)

    def _correct(self, output: torch.Tensor, targets: torch.Tensor) -> int:
        return int((output.argmax(dim=-1) == targets).sum())


class LanguageModel(Task):
    """Next-token prediction: logits (B, T, V), int64 targets (B, T)."""

    name = "lm"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))

    def _correct(self, output: torch.Tensor, targets: torch.Tensor) -> int:
        return 0

    def _metrics(self, loss: float, correct: int, count: int) -> dict[str, float]:
        return {"loss": loss, "bits_per_char": loss / math.log(2)}


class Binary(Task):
    """Binary classification: logits (B,), float targets (B,) in {0, 1}."""

    name = "binary"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output, targets)

    def _correct(self, output: torch.Tensor, targets: torch.Tensor) -> int:
        return int(((output > 0) == (targets > 0.5)).sum())


class Click(Binary):
    """Click prediction: Binary, evaluated by log loss and AUC (as DLRM and CTR models are)."""

    name = "click"

    def evaluate(self, model: nn.Module, dataset: Dataset, batch_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> dict[str, float]:
        metrics = super().evaluate(model, dataset, batch_size, dtype, device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                scores = torch.cat([model(*inputs).float().cpu()
                                    for inputs, _ in test_batches(dataset, batch_size, dtype, device)])
        finally:
            model.train(was_training)
        return {"log_loss": metrics["loss"], "auc": auc(scores, dataset.test_targets), **metrics}


def auc(scores: torch.Tensor, targets: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a random positive scores above a random
    negative (ties count half), from the ranks of the scores (Mann-Whitney U)."""
    scores, positive = scores.double().reshape(-1), targets.reshape(-1) > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    # Tied scores share the mean of their ranks.
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


TASKS: dict[str, Task] = {t.name: t for t in (Classify(), LanguageModel(), Binary(), Click())}


def get_task(name: str) -> Task:
    """The Task called name."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None
