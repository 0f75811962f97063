"""Losses and evaluation metrics per task kind ("classify", "lm", "binary")."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from experiments.data import Dataset, test_batches


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


TASKS: dict[str, Task] = {t.name: t for t in (Classify(), LanguageModel(), Binary())}


def get_task(name: str) -> Task:
    """The Task called name."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}") from None
