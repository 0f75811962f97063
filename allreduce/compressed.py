"""A bucket's exchange under a compressor (experiments/compression, by shape): each worker
adds its error-feedback residual, compresses, and the workers' messages are combined so that
every rank applies the mean of what they all sent.

    compensated = memory.compensate(key, bucket)       # bucket + residual (no memory: bucket)
    message = compressor.compress(compensated, ctx)
    memory.remember(key, compensated, decompress(message))
    messages that add up (random-k):  all-reduce each frame, decompress the sum
    the others (top-k, sign, QSGD):   all-gather each frame, decompress each worker's, add

The bytes are what one rank sends: an all-reduce's 2(N-1)/N of the message, an all-gather's
N-1 messages (they grow with N, which is why a ring prefers methods that add up).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collective import bus_bytes


class _Context:
    """What a compressor reads of where it is (experiments.compression.Context, by shape)."""

    def __init__(self, step: int, key: str, rank: int) -> None:
        self.step, self.key, self.rank = step, key, rank


class _Message:
    """A message rebuilt from reduced or gathered frames (experiments.compression.Message, by shape)."""

    def __init__(self, frames, like) -> None:
        self.frames, self.shape, self.dtype, self.header = tuple(frames), like.shape, like.dtype, like.header


class CompressedExchange:
    """Starts one bucket's compressed exchange; `wait()` on what start returns writes the
    workers' mean into the bucket. collective: the reducer's (its start(flat, None, name)
    all-reduces a frame in place); all-gathers go through torch.distributed."""

    def __init__(self, compressor, memory, rank: int, world: int, collective) -> None:
        self.compressor, self.memory = compressor, memory
        self.rank, self.world, self.collective = rank, world, collective

    def start(self, key: str, flat: torch.Tensor, step: int, name: str):
        compensated = self.memory.compensate(key, flat) if self.memory is not None else flat
        message = self.compressor.compress(compensated, _Context(step, key, self.rank))
        if self.memory is not None:
            self.memory.remember(key, compensated, self.compressor.decompress(message))
        nbytes = self.compressor.nbytes(message)
        if self.compressor.adds_up:
            frames = [frame.clone() for frame in message.frames]
            handles = [self.collective.start(frame, None, f"{name} frame {i}")[0] for i, frame in enumerate(frames)]
            return _Reduced(self, flat, message, frames, handles), bus_bytes(nbytes, self.world)
        gathered = [[torch.empty_like(frame) for _ in range(self.world)] for frame in message.frames]
        works = [dist.all_gather(out, frame.contiguous(), async_op=True)
                 for out, frame in zip(gathered, message.frames)]
        return _Gathered(self, flat, message, gathered, works), nbytes * (self.world - 1)


class _Reduced:
    def __init__(self, exchange, flat, message, frames, handles) -> None:
        self._x, self._flat, self._message, self._frames, self._handles = exchange, flat, message, frames, handles

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        total = self._x.compressor.decompress(_Message(self._frames, self._message))
        self._flat.copy_(total.view_as(self._flat)).div_(self._x.world)


class _Gathered:
    def __init__(self, exchange, flat, message, gathered, works) -> None:
        self._x, self._flat, self._message, self._gathered, self._works = exchange, flat, message, gathered, works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._flat.zero_()
        for w in range(self._x.world):  # in rank order on every rank: the same sum everywhere
            frames = [out[w] for out in self._gathered]
            self._flat.add_(self._x.compressor.decompress(_Message(frames, self._message)).view_as(self._flat))
        self._flat.div_(self._x.world)
