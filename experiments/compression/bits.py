"""Pack booleans 8 to a uint8 (most significant bit first, as numpy.packbits), and back."""

from __future__ import annotations

import torch

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack(bits: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor of n bits -> ceil(n / 8) uint8 (the last byte zero-padded)."""
    flat = bits.reshape(-1).to(torch.uint8)
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8))
    return (padded.view(-1, 8) * _WEIGHTS).sum(1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first n bits of pack's output, as a flat bool tensor."""
    return (packed.view(-1, 1) & _WEIGHTS).ne(0).view(-1)[:n]
