"""Our all-reduce algorithms besides the ring as plans: each rank's steps as plain data (a
peer, what it sends, what it receives and whether it adds or stores it), and one executor
over Gloo's (or NCCL's) point-to-point messages. A plan is tested without processes, and the
bytes a rank moves are known before any message is sent."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from .ring import (MAX_PIECES, PIECE_BYTES, chunk_bounds, piece_count, post_exchange, scratch_buffer,
                   still_sending)


@dataclass(frozen=True)
class Step:
    peer: int
    send: tuple[int, int]
    """Elements [a, b) of the tensor sent to peer ((0, 0): nothing)."""
    recv: tuple[int, int]
    """Elements [a, b) received from peer ((0, 0): nothing)."""
    add: bool
    """Whether what arrives is added (reduce) or stored (gather)."""
    round_owned: tuple[int, int] | None = None
    """Before this step, round these elements to the wire dtype (the segment this rank owns
    once the reduce-scatter is done), so every rank ends bit-identical."""
    src: int | None = None
    """The rank received from where it is not `peer` (a ring's step sends right and receives
    from the left)."""

    @property
    def source(self) -> int:
        return self.peer if self.src is None else self.src


def shifted(steps: list[Step], offset: int) -> list[Step]:
    """A plan for elements [offset, offset + n) of a longer tensor, from one for n elements."""
    def move(r: tuple[int, int] | None):
        return None if r is None else (r[0] + offset, r[1] + offset) if r != (0, 0) else r
    return [Step(st.peer, move(st.send), move(st.recv), st.add, move(st.round_owned), st.src) for st in steps]


def pieces(plan, numel: int, rank: int, world: int, itemsize: int, piece_bytes: int,
           cuda: bool = False, most: int = MAX_PIECES) -> list[list[Step]]:
    """The plan of each piece of the tensor (ring.piece_count's, at most `most`; one on CUDA,
    where NCCL matches a pair's messages by their order alone)."""
    count = 1 if cuda else piece_count(numel * itemsize, piece_bytes, most)
    return [shifted(plan(b - a, rank, world), a) for a, b in chunk_bounds(numel, count)]


def execute(plans: list[list[Step]], flat: torch.Tensor, wire_dtype: torch.dtype | None = None,
            group: dist.ProcessGroup | None = None, delay_s: float = 0.0) -> tuple[int, int]:
    """Run a rank's plans, one per piece of the 1-D tensor `flat` (summed in place), pipelined:
    every piece's first step is in flight at once, and piece j's next step leaves as soon as
    its last one is done, on a thread per piece. Return (bytes sent, received).
    wire_dtype: what travels (partial sums are kept in flat's dtype); delay_s: an injected
    latency paid once per step. A message's tag is its piece: between two ranks each piece's
    messages go in its steps' order on both, so Gloo matches them right. Each step's receive
    is posted while the step before it runs (a tree's 16 MB on 4 ranks at 1gbit took 1.15x
    the model's time with each receive posted when its step came, 1.02x posted ahead)."""
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("an all-reduce needs a contiguous 1-D tensor")
    if not any(plans):
        return 0, 0
    wire = wire_dtype or flat.dtype
    itemsize = torch.empty(0, dtype=wire).element_size()
    n = flat.numel()
    # Two scratch slots, by a step's parity: piece j's ranges lie in its own part of the
    # tensor, and a step's receive is posted while the step before it may still be arriving
    # (twice the tensor, kept for this thread's next call as the ring's is).
    scratch = scratch_buffer(2 * n, wire, flat.device)
    ordered = flat.device.type != "cpu"  # NCCL: a step's receive and send are posted together

    def target(k: int, step: Step) -> torch.Tensor:
        r0, r1 = step.recv
        if step.add or wire != flat.dtype:
            return scratch[(k % 2) * n + r0:(k % 2) * n + r1]
        return flat[r0:r1]

    def post(j: int, k: int, step: Step, moved: list[int], send: bool, recv: bool) -> tuple[list, list]:
        """Post step k of piece j: its send, its receive (either or both); (ops, works)."""
        if send and step.round_owned is not None and wire != flat.dtype:
            a, b = step.round_owned
            flat[a:b] = flat[a:b].to(wire)
        (s0, s1), (r0, r1) = step.send, step.recv
        send, recv = send and s1 > s0, recv and r1 > r0
        moved[0] += (s1 - s0) * itemsize if send else 0
        moved[1] += (r1 - r0) * itemsize if recv else 0
        return post_exchange(flat[s0:s1].to(wire) if send else None, step.peer,
                             target(k, step) if recv else None, step.source, group, tag=j)

    def run_piece(j: int) -> list[int]:
        """Piece j's steps, one after the other, each step's receive posted while the step
        before it runs (Gloo sends a message only once its receive is posted: a parent that
        posted its second child's receive only after the first child's piece had come fell
        behind); the bytes it sent and received."""
        plan, moved, sent = plans[j], [0, 0], []
        arriving: dict[int, list] = {}

        def expect(k: int) -> None:
            if not ordered and k < len(plan):
                arriving[k] = post(j, k, plan[k], moved, send=False, recv=True)[1]

        expect(0)
        for k, step in enumerate(plan):
            if delay_s:
                time.sleep(delay_s)
            expect(k + 1)
            ops, works = post(j, k, step, moved, send=True, recv=ordered)
            if not ordered:
                sent[:] = still_sending(sent)
            sent.append((ops, [] if ordered else works))
            for work in works if ordered else arriving.pop(k):
                work.wait()
            r0, r1 = step.recv
            if r1 > r0:
                into = target(k, step)
                if step.add:
                    flat[r0:r1] += into
                elif into.data_ptr() != flat[r0:r1].data_ptr():
                    flat[r0:r1] = into
        for _, works in sent:
            for work in works:
                work.wait()
        return moved

    if len(plans) == 1:
        return tuple(run_piece(0))
    # Each piece on a thread of its own: piece j's next step leaves the moment its last one is
    # done, however far the other pieces are (in lockstep, a tree's 16 MB on 4 ranks at 1gbit
    # took 1.20x the model's time: its root's steps differ, and a step waited for every piece).
    # MAX_PIECES threads: further pieces wait for one, in order. No deadlock: every rank takes
    # the pieces in the same order, so the lowest piece not done everywhere is running on
    # every rank, and a piece waits only for the same piece on other ranks.
    done = [f.result() for f in [_piece_pool().submit(run_piece, j) for j in range(len(plans))]]
    return sum(m[0] for m in done), sum(m[1] for m in done)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _piece_pool() -> ThreadPoolExecutor:
    """The threads that run a tensor's pieces, one per piece, kept for the process's life."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=MAX_PIECES, thread_name_prefix="psar-piece")
        return _pool


def planned_bytes(plans: list[list[Step]], itemsize: int) -> int:
    """What a rank sends under its plans."""
    return sum(st.send[1] - st.send[0] for plan in plans for st in plan) * itemsize


def planned(plan):
    """(all-reduce, sent_bytes) of an algorithm given by its plan(numel, rank, world)."""
    def allreduce(flat: torch.Tensor, rank: int, world: int, wire_dtype: torch.dtype | None = None,
                  group: dist.ProcessGroup | None = None, delay_s: float = 0.0,
                  piece_bytes: int = PIECE_BYTES, most_pieces: int = MAX_PIECES) -> tuple[int, int]:
        """Sum the 1-D tensor `flat` in place over the ranks; return (bytes sent, received).
        The tensor goes in pipelined pieces of piece_bytes or more (at most most_pieces, of
        which MAX_PIECES are in flight at once)."""
        itemsize = torch.empty(0, dtype=wire_dtype or flat.dtype).element_size()
        plans = pieces(plan, flat.numel(), rank, world, itemsize, piece_bytes, flat.device.type != "cpu",
                       most_pieces)
        return execute(plans, flat, wire_dtype, group, delay_s)

    @lru_cache(maxsize=256)  # asked for every bucket of every step
    def sent_bytes(numel: int, itemsize: int, rank: int, world: int, piece_bytes: int = PIECE_BYTES,
                   most_pieces: int = MAX_PIECES) -> int:
        """What rank `rank` sends for a tensor of numel elements of itemsize bytes (on the CPU)."""
        return planned_bytes(pieces(plan, numel, rank, world, itemsize, piece_bytes, False, most_pieces), itemsize)

    return allreduce, sent_bytes
