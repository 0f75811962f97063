"""Ring all-reduce over point-to-point send/recv: reduce-scatter, then all-gather.

Each of the N ranks sends and receives 2(N-1) chunks of about 1/N of the tensor, so every
link carries 2(N-1)/N of the bytes whatever N is: the bandwidth-optimal algorithm.

Each chunk travels as pieces of `piece_bytes` (at most MAX_PIECES of them, so larger ones for
a large chunk), pipelined: every piece of a hop is on
the wire at once, and piece j goes on to the next rank as soon as it has been summed, while
later pieces are still arriving; the reduction overlaps the transfer instead of following
it (the way NCCL and Gloo's own rings pipeline their chunks).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

PIECE_BYTES = 1 << 20
"""Default smallest size of a pipelined piece on the wire (MAX_PIECES bounds their count):
large enough that a message's fixed cost is small against its transfer, small enough that a
4 MiB chunk overlaps in a few pieces."""


MAX_PIECES = 4
"""At most this many pieces per chunk: a message costs about 0.2 ms on loopback Gloo whatever
its size, so 1 MiB pieces of a 32 MiB chunk paid 13 ms of a 64 MiB all-reduce's 72; four
pieces still overlap most of the summing with the transfer."""
_scratch = threading.local()


def scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of at least numel elements, kept for this thread's next calls: a fresh 32 MiB
    buffer costs its page faults on every call (64 MiB all-reduces on 2 ranks took 1.24-1.44x
    the library's time with one, as long as the library with a kept one)."""
    key = (dtype, str(device))
    kept = getattr(_scratch, "buffers", None)
    if kept is None:
        kept = _scratch.buffers = {}
    buf = kept.get(key)
    if buf is None or buf.numel() < numel:
        buf = kept[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def post_exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
                  group: dist.ProcessGroup | None = None, tag: int = 0) -> tuple[list, list]:
    """Post one step's send of `send` to dst and receive into `recv` from src (None: not this
    step); (the ops, which keep the sent tensor alive, and their works to wait for). Gloo's
    isend and irecv are asynchronous each; NCCL needs them grouped (batch_isend_irecv), or two
    ranks that both send first deadlock, and matches them by order alone (tags are Gloo's).
    The group costs 70 us a hop on Gloo (257 us against 186 for a 1 KiB exchange)."""
    # The receive is posted first: with the send first, Gloo's exchange of 8 MB each way
    # between two hosts at 1gbit took 67 or 133 ms from one time to the next (one direction
    # waiting on the other), with the receive first 70 ms every time, as bare TCP's.
    ops = ([(dist.irecv, recv, src)] if recv is not None else []) + \
        ([(dist.isend, send, dst)] if send is not None else [])
    if not ops:
        return ops, []
    if ops[0][1].device.type != "cpu":
        return ops, dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for op, t, peer in ops])
    return ops, [op(t, peer, group, tag) for op, t, peer in ops]


def piece_count(nbytes: int, piece_bytes: int = PIECE_BYTES) -> int:
    """How many pipelined pieces nbytes go as: pieces of piece_bytes or more, at most MAX_PIECES."""
    return max(1, min(MAX_PIECES, -(-nbytes // piece_bytes)))


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Split `numel` elements into `world` contiguous chunks whose sizes differ by at most one."""
    if world < 1 or numel < 0:
        raise ValueError(f"cannot split {numel} elements over {world} ranks")
    base, extra = divmod(numel, world)
    bounds, start = [], 0
    for i in range(world):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_allreduce(
    flat: torch.Tensor,
    rank: int,
    world: int,
    wire_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    delay_s: float = 0.0,
    piece_bytes: int = PIECE_BYTES,
) -> tuple[int, int]:
    """Sum the 1-D tensor `flat` in place over the ranks of `group`; return (bytes sent, received).

    With `wire_dtype` the chunks travel in that dtype (compression) and partial sums are
    accumulated in `flat`'s own dtype; the reduced chunk is rounded to the wire dtype on its
    owner too, so every rank ends with bit-identical values. `delay_s` is an injected
    latency paid once per hop (2(N-1) times). `piece_bytes` is the smallest message on the
    wire a chunk is cut into, in at most MAX_PIECES (see the module's docstring).
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("ring_allreduce needs a contiguous 1-D tensor")
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    if world == 1:
        return 0, 0
    wire = wire_dtype or flat.dtype
    itemsize = torch.empty(0, dtype=wire).element_size()
    bounds = chunk_bounds(flat.numel(), world)
    longest = bounds[0][1] - bounds[0][0]
    pieces = piece_count(longest * itemsize, piece_bytes)
    right, left = (rank + 1) % world, (rank - 1) % world
    if group is not None:
        right = dist.get_global_rank(group, right)
        left = dist.get_global_rank(group, left)
    scratch = scratch_buffer(longest, wire, flat.device)
    slots = chunk_bounds(longest, pieces)
    moved = [0, 0]  # bytes sent, received

    def piece(idx: int, j: int) -> tuple[int, int]:
        """Elements [a, b) of `flat` that piece j of chunk idx covers."""
        c0, c1 = bounds[idx]
        a, b = chunk_bounds(c1 - c0, pieces)[j]
        return c0 + a, c0 + b

    def post(send_idx: int, recv_idx: int, j: int, into_flat: bool) -> tuple[list, torch.Tensor | None]:
        """Start piece j's exchange: send piece j of chunk send_idx right, receive piece j of
        chunk recv_idx from the left, into `flat` itself (into_flat) or into the scratch."""
        s0, s1 = piece(send_idx, j)
        r0, r1 = piece(recv_idx, j)
        # Piece j has its own slot in the scratch (that of the longest chunk's piece j, which
        # no other chunk's piece j outgrows): the next hop's piece j never lands on a piece
        # still in flight.
        slot = slots[j][0]
        incoming = flat[r0:r1] if into_flat else scratch[slot:slot + r1 - r0]
        moved[0] += (s1 - s0) * itemsize
        moved[1] += (r1 - r0) * itemsize
        return post_exchange(flat[s0:s1].to(wire) if s1 > s0 else None, right,
                             incoming if r1 > r0 else None, left, group), (incoming if r1 > r0 else None)

    def run(phase: list[tuple[int, int]], into_flat: bool, arrived) -> None:
        """The hops of one phase, (send chunk, receive chunk) each, piece by piece: every piece
        of the first hop leaves at once, and piece j of the next hop leaves as soon as piece j
        of this one has arrived and been handled by `arrived(r0, r1, incoming)`, so the link
        never waits for a whole chunk to be summed."""
        if delay_s:
            time.sleep(delay_s)
        flights = [post(*phase[0], j, into_flat) for j in range(pieces)]
        for h, (_, recv_idx) in enumerate(phase):
            if h and delay_s:
                time.sleep(delay_s)
            for j in range(pieces):
                (_, works), incoming = flights[j]
                for work in works:
                    work.wait()
                if incoming is not None:
                    arrived(*piece(recv_idx, j), incoming)
                if h + 1 < len(phase):
                    flights[j] = post(*phase[h + 1], j, into_flat)

    def add(r0: int, r1: int, incoming: torch.Tensor) -> None:
        flat[r0:r1] += incoming

    def store(r0: int, r1: int, incoming: torch.Tensor) -> None:
        if incoming.data_ptr() != flat[r0:r1].data_ptr():
            flat[r0:r1] = incoming

    # Reduce-scatter: hop s sends the chunk it summed in hop s-1; rank r ends owning chunk r+1.
    run([((rank - s) % world, (rank - s - 1) % world) for s in range(world - 1)], False, add)
    owned = (rank + 1) % world
    if wire != flat.dtype:
        o0, o1 = bounds[owned]
        flat[o0:o1] = flat[o0:o1].to(wire)
    # All-gather: uncompressed, the reduced chunks land in place; compressed, they come in the
    # wire dtype and are widened into `flat`.
    run([((rank - s + 1) % world, (rank - s) % world) for s in range(world - 1)], wire == flat.dtype, store)
    return moved[0], moved[1]
