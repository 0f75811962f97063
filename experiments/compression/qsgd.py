"""QSGD: |g| / ||g|| rounded stochastically to one of s levels, with its sign and the norm.

decompress = norm * sign * level / s, where level = floor(s * |g_i| / norm + u_i) and u_i is
uniform on [0, 1) from a generator seeded by (seed, step, key, rank): each worker rounds
independently, and E[level / s] = |g_i| / norm, so the estimate is unbiased; since level <= s,
every |decompressed_i| <= norm.

Frames: norm (one value in the tensor's dtype), levels (uint8 for s <= 255, int16 for
s <= 32767, int32 beyond: the smallest dtype torch has that holds s), signs packed 8 to a
uint8 (bit 1 means >= 0). Wire bytes: element_size + n * level bytes + ceil(n / 8).
Norms and roundings differ per worker, so messages do not add up.
"""

from __future__ import annotations

import torch

from experiments.compression.bits import pack, unpack
from experiments.compression.base import Compressor, Context, Message, expect_header, generator


def level_dtype(levels: int) -> torch.dtype:
    if levels <= 255:
        return torch.uint8
    return torch.int16 if levels <= 32767 else torch.int32


class QSGD(Compressor):
    name = "qsgd"
    adds_up = False
    needs_error_feedback = True  # unbiased, but its variance is large at few levels

    def __init__(self, levels: int, seed: int = 0):
        self.levels, self.seed = levels, seed

    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        flat = tensor.reshape(-1)
        norm = flat.norm().reshape(1)
        u = torch.rand(flat.numel(), generator=generator(self.seed, ctx.step, ctx.key, ctx.rank),
                       dtype=torch.float64)
        scaled = flat.abs().double() / norm.double().clamp_min(torch.finfo(torch.float64).tiny)
        level = torch.floor(scaled * self.levels + u).clamp_(0, self.levels)
        return Message((norm, level.to(level_dtype(self.levels)), pack(flat >= 0)),
                       tuple(tensor.shape), tensor.dtype, (self.levels,))

    def forms(self, shape, dtype, header):
        expect_header(self.name, header, (self.levels,))
        n = torch.Size(shape).numel()
        return [(dtype, (1,)), (level_dtype(self.levels), (n,)), (torch.uint8, (-(-n // 8),))]

    def check(self, message: Message) -> None:
        level = message.frames[1]
        if level.numel() and not (int(level.min()) >= 0 and int(level.max()) <= self.levels):
            raise ValueError(f"qsgd: levels must lie in 0..{self.levels}; got {int(level.min())}..{int(level.max())}")

    def decompress(self, message: Message) -> torch.Tensor:
        norm, level, packed = message.frames
        (levels,) = message.header
        positive = unpack(packed, level.numel())
        signs = torch.where(positive, 1.0, -1.0).to(message.dtype)
        out = signs * level.to(message.dtype) * (norm.to(message.dtype) / levels)
        return out.view(message.shape)
