"""Random-k: k = max(1, ceil(ratio * n)) entries at indices every worker draws alike.

The indices come from a generator seeded by (seed, step, key), so every worker and every
server picks the same ones: only the values cross the wire (one frame, k values in the
tensor's dtype), and the header carries the index seed and k so decompress needs no context.
Because the indices agree, the sum of N workers' messages is the message of the sum: a
ring all-reduces them.

Values are sent unscaled, as GRACE and BytePS do with error feedback: the estimate is
biased (its expectation is k/n times the gradient) and error feedback makes up the rest.
Scaling by n/k would make it unbiased, at n/k times the variance; psar does not scale.
"""

from __future__ import annotations

import functools

import torch

from experiments.compression.base import Compressor, Context, Message, count, expect_header, seed_for


@functools.lru_cache(maxsize=64)
def indices(seed: int, n: int, k: int) -> torch.Tensor:
    """The k indices of a tensor of n elements for a given index seed (sorted, int64). A
    step draws each tensor's indices three times (compress, error feedback, decompress of the
    sum), each a permutation of all n: they are kept for the last 64 (seed, n, k) asked for.
    Callers read them, never write them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:k].sort().values


class RandomK(Compressor):
    name = "randomk"
    adds_up = True
    needs_error_feedback = True

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.seed = ratio, seed

    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        flat = tensor.reshape(-1)
        k = count(self.ratio, flat.numel())
        index_seed = seed_for(self.seed, ctx.step, ctx.key)
        values = flat[indices(index_seed, flat.numel(), k)]
        return Message((values,), tuple(tensor.shape), tensor.dtype, (index_seed, k))

    def forms(self, shape, dtype, header):
        n = torch.Size(shape).numel()
        expect_header(self.name, header, 2)
        k = count(self.ratio, n)
        if header[1] != k or not 0 <= header[0] < 2**63:
            raise ValueError(f"randomk: message header {list(header)}; expected [index seed in 0..2**63-1, k={k}]")
        return [(dtype, (k,))]

    def decompress(self, message: Message) -> torch.Tensor:
        index_seed, k = message.header
        n = torch.Size(message.shape).numel()
        values = message.frames[0]
        out = torch.zeros(n, dtype=message.dtype, device=values.device)
        out[indices(index_seed, n, k).to(values.device)] = values.to(message.dtype)
        return out.view(message.shape)
