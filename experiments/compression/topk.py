"""Top-k: the k = max(1, ceil(ratio * n)) entries of largest magnitude, with their indices.

Frames: values (the tensor's dtype, k of them), indices (int32, or int64 past 2**31 - 1
elements). Each worker picks its own indices, so messages do not add up: a ring all-gathers.
Biased (it drops the small entries), so error feedback is on by default.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from experiments.compression.base import Compressor, Context, Message, count, expect_header, index_dtype


class TopK(Compressor):
    name = "topk"
    adds_up = False
    needs_error_feedback = True

    def __init__(self, ratio: float):
        self.ratio = ratio

    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        flat = tensor.reshape(-1)
        k = count(self.ratio, flat.numel())
        indices = largest(flat.detach().abs(), k)
        return Message((flat[indices], indices.to(index_dtype(flat.numel()))),
                       tuple(tensor.shape), tensor.dtype)

    def forms(self, shape, dtype, header):
        expect_header(self.name, header, ())
        n = torch.Size(shape).numel()
        k = count(self.ratio, n)
        return [(dtype, (k,)), (index_dtype(n), (k,))]

    def check(self, message: Message) -> None:
        indices, n = message.frames[1], torch.Size(message.shape).numel()
        if indices.numel() and not (int(indices.min()) >= 0 and int(indices.max()) < n):
            raise ValueError(f"topk: indices must lie in 0..{n - 1}; got {int(indices.min())}..{int(indices.max())}")

    def decompress(self, message: Message) -> torch.Tensor:
        values, indices = message.frames
        out = torch.zeros(torch.Size(message.shape).numel(), dtype=message.dtype, device=values.device)
        out[indices.long()] = values.to(message.dtype)
        return out.view(message.shape)


SAMPLE = 8192
"""Magnitudes largest() samples for its threshold: at most this many, at least every 17th."""
SMALLEST = 16384
"""largest() leaves a tensor of fewer entries to torch.topk: 0.17 ms for 16,384 (k = 1%)."""
_THRESHOLDED = (torch.float32, torch.float64, torch.float16)
"""dtypes whose entries numpy compares (bfloat16 is not among numpy's)."""


def sample_stride(n: int) -> int:
    """largest()'s sample of n entries takes every this-many-th: odd, since a row length
    that divided the stride would bias the sample."""
    return max(16, n // SAMPLE) | 1


def largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64, in no order) of the k largest entries of mag (flat), the set
    torch.topk finds (NaN counted largest, as there; ties at the k-th value broken either
    way), in less of its time on a CPU tensor (k = 1%: 4,194,304 entries 12.6 ms against
    128, 401,408 1.26 against 6.76, 32,768 0.18 against 0.37). As Deep Gradient Compression
    selects: a threshold from a sample, about 1.5 times the sample's share of the k largest
    taken from every s-th entry (sample_stride), then torch.topk among the entries not
    below it (numpy finds them: torch's comparison and nonzero took 2.2 of the 6.6 ms). Exact: at least k entries not below the threshold
    means the k-th largest is not below it, so each of the k largest is among them; with
    fewer (the sample overshot), torch.topk over all."""
    n = mag.numel()
    if n < SMALLEST or 8 * k > n or mag.device.type != "cpu" or mag.dtype not in _THRESHOLDED:
        return torch.topk(mag, k, sorted=False).indices
    sample = mag[::sample_stride(n)]
    expect = k * sample.numel() / n
    q = min(sample.numel(), math.ceil(1.5 * expect + 3 * math.sqrt(expect) + 1))
    threshold = torch.topk(sample, q, sorted=False).values.min().item()
    candidates = torch.from_numpy(np.flatnonzero(~(mag.numpy() < threshold)))  # NaN: a candidate
    if candidates.numel() < k:
        return torch.topk(mag, k, sorted=False).indices
    return candidates[torch.topk(mag[candidates], k, sorted=False).indices]
