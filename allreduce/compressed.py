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

import contextlib
import time

import torch
import torch.distributed as dist

from .collective import bus_bytes


class Timed:
    """The seconds an exchange spends compressing, decompressing and on error feedback (not
    waiting for collectives): what a step pays for its compression on the CPU."""

    seconds = 0.0

    @contextlib.contextmanager
    def timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class _Context:
    """What a compressor reads of where it is (experiments.compression.Context, by shape)."""

    def __init__(self, step: int, key: str, rank: int) -> None:
        self.step, self.key, self.rank = step, key, rank


class _Message:
    """A message rebuilt from reduced or gathered frames (experiments.compression.Message, by shape)."""

    def __init__(self, frames, like) -> None:
        self.frames, self.shape, self.dtype, self.header = tuple(frames), like.shape, like.dtype, like.header


class CompressedExchange(Timed):
    """Starts one bucket's compressed exchange; `wait()` on what start returns writes the
    workers' mean into the bucket. collective: the reducer's (its start(flat, None, name)
    all-reduces a frame in place); all-gathers go through torch.distributed."""

    def __init__(self, compressor, memory, rank: int, world: int, collective) -> None:
        self.compressor, self.memory = compressor, memory
        self.rank, self.world, self.collective = rank, world, collective

    def start(self, key: str, flat: torch.Tensor, step: int, name: str, params=()):
        with self.timed():
            compensated = self.memory.compensate(key, flat) if self.memory is not None else flat
            message = self.compressor.compress(compensated, _Context(step, key, self.rank))
            if self.memory is not None:
                self.memory.remember(key, compensated, self.compressor.decompress(message))
        nbytes, decompress = self.compressor.nbytes(message), self.compressor.decompress
        if self.compressor.adds_up:
            frames = [frame.clone() for frame in message.frames]
            handles = [self.collective.start(frame, None, f"{name} frame {i}")[0] for i, frame in enumerate(frames)]

            def reduced() -> None:
                with self.timed():
                    flat.copy_(decompress(_Message(frames, message)).view_as(flat)).div_(self.world)

            return _Pending(handles, reduced), bus_bytes(nbytes, self.world)
        gathered = [[torch.empty_like(frame) for _ in range(self.world)] for frame in message.frames]
        works = [dist.all_gather(out, frame.contiguous(), async_op=True)
                 for out, frame in zip(gathered, message.frames)]

        def added() -> None:
            with self.timed():
                flat.zero_()
                for w in range(self.world):  # in rank order on every rank: the same sum everywhere
                    flat.add_(decompress(_Message([out[w] for out in gathered], message)).view_as(flat))
                flat.div_(self.world)

        return _Pending(works, added), nbytes * (self.world - 1)


class _Pending:
    """What start() returns: wait() waits for the collectives, then combines their results."""

    def __init__(self, waits, combine) -> None:
        self._waits, self._combine = waits, combine

    def wait(self) -> None:
        for w in self._waits:
            w.wait()
        self._combine()


class PowerSGDExchange(Timed):
    """PowerSGD per bucket, as torch's powerSGD_hook runs it (compressor: experiments'
    PowerSGD, by shape: compresses / project / finish / reconstruct and its Q memory).

    The bucket plus its error-feedback residual is cut into its parameters; the matrices the
    compressor compresses at this step send P (all-reduced, summed), then Q (all-reduced,
    divided by N), the others go whole in one all-reduce (divided by N). Q's first values are
    torch's: one seed per bucket from numpy's RandomState(seed), drawn in the bucket's
    shape-grouped order at its first compressed step, so that a bucket laid out as DDP's
    ends as torch's hook does. The residual is what this worker had minus what the step
    applies (the mean for whole tensors, the approximation for the others), as torch keeps it.
    """

    def __init__(self, compressor, memory, rank: int, world: int, collective, seed: int) -> None:
        import numpy as np

        self.compressor, self.memory = compressor, memory
        self.rank, self.world, self.collective = rank, world, collective
        self._rng = np.random.RandomState(seed)
        self._drawn: set[str] = set()

    def start(self, key: str, flat: torch.Tensor, step: int, name: str, params=()):
        """params: (name, shape) of the bucket's parameters, in its order."""
        with self.timed():
            return self._start(key, flat, step, name, params)

    def _start(self, key: str, flat: torch.Tensor, step: int, name: str, params):
        compensated = self.memory.compensate(key, flat) if self.memory is not None else flat
        parts, offset = [], 0
        for pname, shape in params:
            n = torch.Size(shape).numel()
            parts.append((pname, shape, compensated[offset: offset + n].view(shape)))
            offset += n
        squeezed, whole = [], []
        for part in parts:
            (squeezed if self.compressor.compresses(tuple(part[1]), step) else whole).append(part)
        if squeezed and key not in self._drawn:
            self._draw_first_q(squeezed, flat.dtype)
            self._drawn.add(key)
        ctx = {pname: _Context(step, pname, self.rank) for pname, _, _ in parts}
        dense = torch.cat([t.reshape(-1) for _, _, t in whole]) if whole else flat.new_zeros(0)
        ps = torch.cat([self.compressor.project(t, ctx[pname]).reshape(-1) for pname, _, t in squeezed]) \
            if squeezed else flat.new_zeros(0)
        handles = [self.collective.start(t, None, f"{name} {what}")[0]
                   for t, what in ((dense, "whole"), (ps, "P")) if t.numel()]
        nbytes = dense.numel() * flat.element_size()  # and P now, Q at wait():
        nbytes += sum(self.compressor.compressed_nbytes(tuple(s), flat.dtype) for _, s, _ in squeezed)
        order = [pname for pname, _, _ in parts]
        return _PowerSGDStep(self, key, flat, compensated, order, whole, squeezed, ctx, dense, ps, handles), \
            bus_bytes(nbytes, self.world)

    def _draw_first_q(self, squeezed, dtype: torch.dtype) -> None:
        groups: dict[torch.Size, list] = {}
        for pname, shape, _ in squeezed:
            groups.setdefault(torch.Size((shape[0], torch.Size(shape).numel() // shape[0])), []).append((pname, shape))
        generator = torch.Generator().manual_seed(int(self._rng.randint(1_000_000_000)))
        for (_, m), members in groups.items():
            for pname, shape in members:
                r = self.compressor.matrix_rank(tuple(shape))
                self.compressor.q[pname] = torch.randn(1, m, r, generator=generator, dtype=dtype)[0]


class _PowerSGDStep:
    def __init__(self, x, key, flat, compensated, order, whole, squeezed, ctx, dense, ps, handles) -> None:
        self._x, self._key, self._flat, self._compensated, self._order = x, key, flat, compensated, order
        self._whole, self._squeezed, self._ctx = whole, squeezed, ctx
        self._dense, self._ps, self._handles = dense, ps, handles

    def wait(self) -> None:
        x = self._x
        for handle in self._handles:
            handle.wait()
        result = {}
        offset = 0
        for pname, shape, _ in self._whole:
            n = torch.Size(shape).numel()
            result[pname] = self._dense[offset: offset + n].view(shape) / x.world
            offset += n
        finished, offset = [], 0
        for pname, shape, matrix in self._squeezed:
            n, r = shape[0], x.compressor.matrix_rank(tuple(shape))
            p_sum = self._ps[offset: offset + n * r].view(n, r)
            offset += n * r
            with x.timed():
                finished.append(x.compressor.finish(matrix, p_sum, self._ctx[pname]))
        if finished:
            qs = torch.cat([q.reshape(-1) for _, q in finished])
            handle, _ = x.collective.start(qs, None, "Q")
            handle.wait()
            offset = 0
            for (pname, shape, _), (p, q) in zip(self._squeezed, finished):
                q_mean = qs[offset: offset + q.numel()].view_as(q) / x.world
                offset += q.numel()
                with x.timed():
                    result[pname] = x.compressor.reconstruct(p, q_mean, self._ctx[pname], tuple(shape))
        applied = torch.cat([result[pname].reshape(-1) for pname in self._order])  # the bucket's order
        if x.memory is not None:
            x.memory.remember(self._key, self._compensated, applied)
        self._flat.copy_(applied)
