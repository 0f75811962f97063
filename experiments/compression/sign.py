"""1-bit sign with one scale (EF-signSGD): decompress(g) = mean(|g|) * sign(g).

Frames: scale (one value in the tensor's dtype), signs packed 8 to a uint8, most significant
bit first (bit 1 means >= 0, so a zero is sent as +scale). Wire bytes: element_size +
ceil(n / 8). Scales differ per worker, so messages do not add up. Biased: error feedback on.
"""

from __future__ import annotations

import torch

from experiments.compression.bits import pack, unpack
from experiments.compression.base import Compressor, Context, Message, expect_header


class Sign(Compressor):
    name = "sign"
    adds_up = False
    needs_error_feedback = True

    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        flat = tensor.reshape(-1)
        scale = flat.abs().mean().reshape(1)
        return Message((scale, pack(flat >= 0)), tuple(tensor.shape), tensor.dtype)

    def forms(self, shape, dtype, header):
        expect_header(self.name, header, ())
        return [(dtype, (1,)), (torch.uint8, (-(-torch.Size(shape).numel() // 8),))]

    def decompress(self, message: Message) -> torch.Tensor:
        scale, packed = message.frames
        n = torch.Size(message.shape).numel()
        positive = unpack(packed, n)
        signs = torch.where(positive, 1.0, -1.0).to(message.dtype)
        return (signs * scale.to(message.dtype)).view(message.shape)
