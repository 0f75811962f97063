"""Error feedback: a per-key memory of what compression left out, added to the next gradient.

    compensated = memory.compensate(key, grad)          # grad + residual (grad itself at first)
    sent = <decompress what was sent, or the reduced result>
    memory.remember(key, compensated, sent)             # residual = compensated - sent

Over T steps, sum of sent + final residual == sum of grads (exactly, up to rounding).
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    def __init__(self) -> None:
        self.residuals: dict[str | int, torch.Tensor] = {}

    def compensate(self, key: str | int, grad: torch.Tensor) -> torch.Tensor:
        residual = self.residuals.get(key)
        return grad if residual is None else grad + residual

    def remember(self, key: str | int, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self.residuals[key] = compensated - sent.to(compensated.dtype).view_as(compensated)

    def residual(self, key: str | int) -> torch.Tensor | None:
        return self.residuals.get(key)
