"""Top-k: the k = max(1, ceil(ratio * n)) entries of largest magnitude, with their indices.

Frames: values (the tensor's dtype, k of them), indices (int32, or int64 past 2**31 - 1
elements). Each worker picks its own indices, so messages do not add up: a ring all-gathers.
Biased (it drops the small entries), so error feedback is on by default.
"""

from __future__ import annotations

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
        indices = torch.topk(flat.abs(), k, sorted=False).indices
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
