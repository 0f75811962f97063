"""What the engine zero keeps per bucket (or stage 3's unit), and the collectives it runs on."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _collective(name: str):
    """torch's name for a collective on single tensors (torch 2.13 renamed them *_single)."""
    new = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}[name]
    return getattr(dist, new, None) or getattr(dist, name)


REDUCE_SCATTER = _collective("reduce_scatter_tensor")
ALL_GATHER = _collective("all_gather_into_tensor")


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class Bucket:
    names: list[str]
    params: list[torch.nn.Parameter]
    values: torch.Tensor
    """The parameters' flat buffer, padded to a multiple of N (their .data are views of it);
    under stage 3 its storage is there only while the bucket is gathered."""
    piece: torch.nn.Parameter
    """This rank's 1/N of values, what its optimizer steps: the same storage under stages 1
    and 2, its own under stage 3."""
    offsets: list[int]
    """Where each parameter starts in values (and in a gradient buffer)."""
    grad: torch.Tensor | None = None
    """Stage 1: the whole gradient buffer (the parameters' .grad are views of it)."""
    filling: torch.Tensor | None = None
    """Stages 2 and 3: the gradient buffer the parameters' gradients are copied into as they come."""
    sending: torch.Tensor | None = None
    """Stages 2 and 3: the gradient being reduce-scattered, freed once it is."""
    ready: set[int] = field(default_factory=set)
    handle: dist.Work | None = None
    gathered: bool = True
    """Stage 3: its storage is allocated (its values in, or on their way)."""
    gathering: dist.Work | None = None
    """Stage 3: the all-gather of its values under way."""


class LibraryCollectives:
    """The backend's reduce-scatter and all-gather (Gloo on CPU, NCCL on CUDA): rank r owns
    chunk r of a bucket."""

    def __init__(self, rank: int, world: int) -> None:
        self.owner = rank

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor):
        with warnings.catch_warnings():  # torch 2.13 warns that the older names are going
            warnings.simplefilter("ignore", FutureWarning)
            return REDUCE_SCATTER(out, flat, async_op=True)

    def all_gather(self, values: torch.Tensor, piece: torch.Tensor):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return ALL_GATHER(values, piece, async_op=True)

    def close(self) -> None:
        pass


class _RingWork:
    """A ring half run on the collectives' thread; wait() then puts the owned chunk where it
    goes (a reduce-scatter's output that is not a view of the summed buffer)."""

    def __init__(self, future, copy: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._future, self._copy = future, copy

    def is_completed(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()
        if self._copy is not None:
            out, chunk = self._copy
            out.copy_(chunk)
            self._copy = None


class RingCollectives:
    """psar's own ring, its two halves (allreduce/ring.py), one after another on one thread in
    the order they are started, which every rank shares: rank r owns chunk (r + 1) % N, where
    the reduce-scatter half leaves the sum. delay_s: an injected latency paid once per hop
    (fault.delay_ms, or net.latency_ms where the kernel has no netem), N-1 times a half."""

    def __init__(self, rank: int, world: int, delay_s: float = 0.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from .ring import owner_chunk

        self.rank, self.world, self.delay_s = rank, world, delay_s
        self.owner = owner_chunk(rank, world)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psar-zero-ring")

    def _chunk(self, flat: torch.Tensor) -> torch.Tensor:
        size = flat.numel() // self.world
        return flat[self.owner * size: (self.owner + 1) * size]

    def reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor) -> _RingWork:
        from .ring import ring_allreduce

        future = self._pool.submit(ring_allreduce, flat, self.rank, self.world, phase="reduce_scatter",
                                   delay_s=self.delay_s)
        chunk = self._chunk(flat)
        return _RingWork(future, None if out.data_ptr() == chunk.data_ptr() else (out, chunk))

    def all_gather(self, values: torch.Tensor, piece: torch.Tensor) -> _RingWork:
        from .ring import ring_allreduce

        chunk = self._chunk(values)

        def gather() -> None:
            if chunk.data_ptr() != piece.data_ptr():
                chunk.copy_(piece)
            ring_allreduce(values, self.rank, self.world, phase="all_gather", delay_s=self.delay_s)

        return _RingWork(self._pool.submit(gather))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
