"""none, fp16, bf16: the tensor itself, or cast to a 2-byte float. Their messages add up."""

from __future__ import annotations

import torch

from experiments.compression.base import Compressor, Context, Message, expect_header


class Cast(Compressor):
    """One frame: the tensor in `wire` dtype (None: as it is, not copied)."""

    adds_up = True

    def __init__(self, name: str, wire: torch.dtype | None):
        self.name, self.wire = name, wire

    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        frame = tensor if self.wire is None else tensor.to(self.wire)
        return Message((frame,), tuple(tensor.shape), tensor.dtype)

    def forms(self, shape, dtype, header):
        expect_header(self.name, header, ())
        return [(self.wire or dtype, tuple(shape))]

    def decompress(self, message: Message) -> torch.Tensor:
        return message.frames[0].to(message.dtype).view(message.shape)


def none() -> Cast:
    return Cast("none", None)


def fp16() -> Cast:
    return Cast("fp16", torch.float16)


def bf16() -> Cast:
    return Cast("bf16", torch.bfloat16)
