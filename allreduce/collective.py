"""Asynchronous all-reduce of one flat bucket, by the backend's algorithm or our ring.

Both return a handle whose `wait()` finishes the reduction in place, so the reducer is
written once for either algorithm.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import torch.distributed as dist

from .ring import ring_allreduce


class Handle(Protocol):
    def wait(self) -> None: ...


class _LibraryHandle:
    def __init__(self, work: dist.Work, flat: torch.Tensor, wire: torch.Tensor) -> None:
        self._work, self._flat, self._wire = work, flat, wire

    def wait(self) -> None:
        self._work.wait()
        if self._wire is not self._flat:
            self._flat.copy_(self._wire)


class _FutureHandle:
    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> None:
        self._future.result()


def bus_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends (and receives) in a bandwidth-optimal all-reduce of `nbytes`."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


class LibraryAllReduce:
    """The backend's own all-reduce (Gloo on CPU, NCCL on CUDA), started with async_op."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def start(self, flat: torch.Tensor, wire_dtype: torch.dtype | None) -> tuple[Handle, int]:
        wire = flat if wire_dtype is None else flat.to(wire_dtype)
        work = dist.all_reduce(wire, async_op=True)
        return _LibraryHandle(work, flat, wire), bus_bytes(wire.numel() * wire.element_size(), self.world)

    def close(self) -> None:
        pass


class RingAllReduce:
    """Our ring, run bucket after bucket on one thread so that it overlaps backward."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        # One thread keeps buckets in launch order, which every rank shares.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psar-ring")

    def start(self, flat: torch.Tensor, wire_dtype: torch.dtype | None) -> tuple[Handle, int]:
        future = self._pool.submit(ring_allreduce, flat, self.rank, self.world, wire_dtype)
        itemsize = torch.empty(0, dtype=wire_dtype or flat.dtype).element_size()
        return _FutureHandle(future), bus_bytes(flat.numel() * itemsize, self.world)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_collective(algorithm: str, rank: int, world: int) -> LibraryAllReduce | RingAllReduce:
    if algorithm == "library":
        return LibraryAllReduce(rank, world)
    if algorithm == "ring":
        return RingAllReduce(rank, world)
    raise ValueError(f"allreduce.algorithm={algorithm!r}: expected library or ring")
