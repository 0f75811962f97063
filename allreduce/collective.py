"""Asynchronous all-reduce of one flat bucket, by the backend's algorithm or our ring.

Both return a handle whose `wait()` finishes the reduction in place, so the reducer is
written once for either algorithm.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from . import halving, hierarchical, tree
from .auto import choose, most_pieces
from .ring import MAX_PIECES, ring_allreduce

PLANNED = {"halving-doubling": (halving.halving_doubling_allreduce, halving.sent_bytes),
           "tree": (tree.tree_allreduce, tree.sent_bytes)}
"""Our algorithms other than the ring, by allreduce.algorithm: (all-reduce, the bytes a rank
sends) (allreduce/steps.py)."""


def ours(algorithm: str, racks: tuple[int, ...] | None = None, emulated: bool = False,
         crowded: float = 1.0) -> tuple[Callable, Callable | None]:
    """(all-reduce, the bytes a rank sends) of our `algorithm` (hierarchical's over `racks`),
    in as many pieces as auto.most_pieces gives it (emulated: on emulated links; crowded:
    ranks per core); the ring's bytes are bus_bytes (None)."""
    if algorithm == "hierarchical":
        fn, sent = hierarchical.algorithm(racks)
    elif algorithm in PLANNED:
        fn, sent = PLANNED[algorithm]
    elif algorithm == "ring":
        fn, sent = ring_allreduce, None
    else:
        raise ValueError(f"{algorithm!r} is not one of our all-reduce algorithms")
    most = most_pieces(algorithm, emulated, crowded)
    if most == MAX_PIECES:
        return fn, sent
    return partial(fn, most_pieces=most), sent and partial(sent, most_pieces=most)


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


Trace = Callable[..., None]


def _traced(future: Future, trace: Trace | None, name: str, start: float) -> Future:
    if trace is not None:
        future.add_done_callback(lambda _: trace(name, start, time.time(), thread="comm"))
    return future


class LibraryAllReduce:
    """The backend's own all-reduce (Gloo on CPU, NCCL on CUDA), started with async_op.

    With `delay_s` (an injected link latency) each all-reduce starts 2(N-1) message delays
    late, on a thread of its own so that backward is not held up.
    """

    def __init__(self, rank: int, world: int, trace: Trace | None = None, delay_s: float = 0.0) -> None:
        self.rank, self.world, self.trace, self.delay_s = rank, world, trace, delay_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psar-delay") if delay_s else None

    def start(self, flat: torch.Tensor, wire_dtype: torch.dtype | None, name: str = "bucket") -> tuple[Handle, int]:
        wire = flat if wire_dtype is None else flat.to(wire_dtype)
        nbytes = bus_bytes(wire.numel() * wire.element_size(), self.world)
        begin = time.time()
        if self._pool is not None:
            def delayed() -> None:
                time.sleep(2 * (self.world - 1) * self.delay_s)
                dist.all_reduce(wire)
            future = _traced(self._pool.submit(delayed), self.trace, name, begin)
            return _LibraryHandle(_FutureHandle(future), flat, wire), nbytes
        work = dist.all_reduce(wire, async_op=True)
        if self.trace is not None:
            work.get_future().then(lambda _: self.trace(name, begin, time.time(), thread="comm"))
        return _LibraryHandle(work, flat, wire), nbytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class RingAllReduce:
    """Our own algorithm over point-to-point messages (the ring; the others by `algorithm`),
    run bucket after bucket on one thread so that it overlaps backward. racks: each rank's
    rack (hierarchical's groups, auto's model); uplink: the racks' uplinks' bytes/s; crowded:
    ranks per core on this machine (auto's model)."""

    def __init__(self, rank: int, world: int, trace: Trace | None = None, delay_s: float = 0.0,
                 algorithm: str = "ring", bandwidth: float | None = None,
                 racks: tuple[int, ...] | None = None, uplink: float | None = None, crowded: float = 1.0) -> None:
        self.rank, self.world, self.trace, self.delay_s = rank, world, trace, delay_s
        self.algorithm, self.bandwidth, self.racks, self.uplink = algorithm, bandwidth, racks, uplink
        self.crowded = crowded
        if algorithm == "hierarchical" and racks is None:
            raise ValueError("allreduce.algorithm=hierarchical needs each rank's rack")
        self.chosen: dict[str, int] = {}  # auto: how many all-reduces each algorithm ran
        # One thread keeps buckets in launch order, which every rank shares.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psar-ring")

    def start(self, flat: torch.Tensor, wire_dtype: torch.dtype | None, name: str = "bucket") -> tuple[Handle, int]:
        itemsize = torch.empty(0, dtype=wire_dtype or flat.dtype).element_size()
        algorithm = self.algorithm
        if algorithm == "auto":
            algorithm = choose(flat.numel() * itemsize, self.world, self.delay_s, self.bandwidth,
                               self.racks, self.uplink, self.crowded)
            self.chosen[algorithm] = self.chosen.get(algorithm, 0) + 1
            name = f"{name} [{algorithm}]"
        fn, sent_bytes = ours(algorithm, self.racks, self.bandwidth is not None, self.crowded)
        future = self._pool.submit(fn, flat, self.rank, self.world, wire_dtype, delay_s=self.delay_s)
        future = _traced(future, self.trace, name, time.time())
        if sent_bytes is not None:  # what this rank sends under its plan
            return _FutureHandle(future), sent_bytes(flat.numel(), itemsize, self.rank, self.world)
        return _FutureHandle(future), bus_bytes(flat.numel() * itemsize, self.world)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def make_collective(algorithm: str, rank: int, world: int, trace: Trace | None = None,
                    delay_s: float = 0.0, bandwidth: float | None = None,
                    racks: tuple[int, ...] | None = None, uplink: float | None = None,
                    crowded: float = 1.0) -> LibraryAllReduce | RingAllReduce:
    """bandwidth: the links' bytes per second (auto's model; None: loopback's); racks: each
    rank's rack, uplink: their uplinks' bytes/s (hierarchical, auto); crowded: ranks per core."""
    if algorithm == "library":
        return LibraryAllReduce(rank, world, trace, delay_s)
    if algorithm in ("ring", "auto", "hierarchical") or algorithm in PLANNED:
        return RingAllReduce(rank, world, trace, delay_s, algorithm, bandwidth, racks, uplink, crowded)
    raise ValueError(f"allreduce.algorithm={algorithm!r}: expected library, ring, {', '.join(PLANNED)}, "
                     "hierarchical or auto")
