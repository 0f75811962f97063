"""Ring all-reduce over point-to-point send/recv: reduce-scatter, then all-gather.

Each of the N ranks sends and receives 2(N-1) chunks of about 1/N of the tensor, so every
link carries 2(N-1)/N of the bytes whatever N is: the bandwidth-optimal algorithm.

Each chunk travels as pieces of `piece_bytes` (at most MAX_PIECES of them, so larger ones for
a large chunk), pipelined: every piece of a hop is on the wire at once, and piece j goes on
to the next rank as soon as it has been summed, while later pieces are still arriving; the
reduction overlaps the transfer instead of following it (the way NCCL and Gloo's own rings
pipeline their chunks). Each piece's receives are posted two hops ahead, as Gloo's own ring
posts its next segments': Gloo sends a message only once the receiver has posted its
receive, so a receive posted when the previous hop's piece had arrived cost every hop a round
trip of notices (4 ranks on 1gbit links: 4 KB took 7.1 ms, 5.3 ms posted ahead).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

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
    step); (the ops, which keep the sent tensor alive, and their works to wait for). dst and
    src are ranks of `group`. Gloo's isend and irecv are asynchronous each; NCCL needs them
    grouped (batch_isend_irecv), or two ranks that both send first deadlock, and matches them
    by order alone (tags are Gloo's)."""
    # The receive is posted first: with the send first, Gloo's exchange of 8 MB each way
    # between two hosts at 1gbit took 67 or 133 ms from one time to the next (one direction
    # waiting on the other), with the receive first 70 ms every time, as bare TCP's.
    ops = ([(P2P.recv, recv, src)] if recv is not None else []) + \
        ([(P2P.send, send, dst)] if send is not None else [])
    if not ops:
        return ops, []
    if ops[0][1].device.type != "cpu":
        return ops, dist.batch_isend_irecv([dist.P2POp(dist.irecv if op is P2P.recv else dist.isend, t,
                                                       _global(group, peer), group) for op, t, peer in ops])
    return ops, [op(t, peer, group, tag) for op, t, peer in ops]


def still_sending(sends: list[tuple[list, list]]) -> list[tuple[list, list]]:
    """The (ops, works) of the sends not yet gone; those gone are waited (an error surfaces)
    and dropped, and with their ops the compressed copies they kept alive."""
    out = []
    for ops, works in sends:
        if all(w.is_completed() for w in works):
            for w in works:
                w.wait()
        else:
            out.append((ops, works))
    return out


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class P2P:
    """Gloo's point-to-point messages, called on the process group itself with the group's
    own rank numbers (dist.isend and dist.irecv check their arguments on every call: a 1 KiB
    exchange through them took 200 to 238 us on this machine, 138 to 175 without)."""

    @staticmethod
    def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
        return (group or dist.group.WORLD).send([tensor], dst, tag)

    @staticmethod
    def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
        return (group or dist.group.WORLD).recv([tensor], src, tag)


def piece_count(nbytes: int, piece_bytes: int = PIECE_BYTES, most: int = MAX_PIECES) -> int:
    """How many pipelined pieces nbytes go as: pieces of piece_bytes or more, at most `most`."""
    return max(1, min(most, -(-nbytes // piece_bytes)))


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


PHASES = ("", "reduce_scatter", "all_gather")


def owner_chunk(rank: int, world: int) -> int:
    """The chunk (of chunk_bounds(numel, world)) the reduce-scatter half leaves summed on rank."""
    return (rank + 1) % world


def ring_allreduce(
    flat: torch.Tensor,
    rank: int,
    world: int,
    wire_dtype: torch.dtype | None = None,
    group: dist.ProcessGroup | None = None,
    delay_s: float = 0.0,
    piece_bytes: int = PIECE_BYTES,
    most_pieces: int = MAX_PIECES,
    phase: str = "",
) -> tuple[int, int]:
    """Sum the 1-D tensor `flat` in place over the ranks of `group`; return (bytes sent, received).

    phase: "" runs both halves; "reduce_scatter" only the first, after which rank r holds
    the sum of chunk owner_chunk(r) (chunk_bounds' (r + 1) % N) and the rest of `flat` is
    partial; "all_gather" only the second, which passes every rank's chunk owner_chunk(r)
    on to every other rank (ZeRO's two collectives, allreduce/zero.py).

    With `wire_dtype` the chunks travel in that dtype (compression) and partial sums are
    accumulated in `flat`'s own dtype; the reduced chunk is rounded to the wire dtype on its
    owner too, so every rank ends with bit-identical values. `delay_s` is an injected
    latency of every message: on Gloo each piece's send leaves that long after the piece is
    ready (2(N-1) times along each piece's way, the pieces overlapping); on NCCL a pause
    before each hop. `piece_bytes` is the smallest message on the
    wire a chunk is cut into, in at most most_pieces (see the module's docstring).
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("ring_allreduce needs a contiguous 1-D tensor")
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    if phase not in PHASES:
        raise ValueError(f"ring phase {phase!r}: expected one of {PHASES}")
    if world == 1:
        return 0, 0
    wire = wire_dtype or flat.dtype
    itemsize = torch.empty(0, dtype=wire).element_size()
    bounds = chunk_bounds(flat.numel(), world)
    longest = bounds[0][1] - bounds[0][0]
    pieces = piece_count(longest * itemsize, piece_bytes, most_pieces)
    right, left = (rank + 1) % world, (rank - 1) % world
    hops = 2 * (world - 1)  # world - 1 of the reduce-scatter, then as many of the all-gather
    first, last = {"": (0, hops), "reduce_scatter": (0, world - 1), "all_gather": (world - 1, hops)}[phase]
    scratch = scratch_buffer(2 * longest, wire, flat.device)  # two chunks: a hop's slot, the next one's
    slots = chunk_bounds(longest, pieces)
    ordered = flat.device.type != "cpu"  # NCCL: a hop's receive and send are posted together
    moved = [0, 0]  # bytes sent, received
    kept: list = []  # the sends in flight (their ops keep the tensors they send alive)

    def piece(hop: int, j: int, sent: bool = False) -> tuple[int, int]:
        """Elements [a, b) of `flat` of piece j of the chunk hop `hop` receives (sent: sends).
        Hop h receives chunk rank-h-1 and sends chunk rank-h: in the reduce-scatter rank r
        ends owning chunk r+1, which the all-gather then passes on."""
        c0, c1 = bounds[(rank - hop - (0 if sent else 1)) % world]
        a, b = chunk_bounds(c1 - c0, pieces)[j]
        return c0 + a, c0 + b

    def target(hop: int, j: int) -> torch.Tensor:
        """Where piece j of hop `hop` arrives: the all-gather's reduced values in place
        (uncompressed), anything else in the scratch slot of the hop's parity, piece j's part
        of it (no later hop of piece j that may be posted while one is in flight shares it)."""
        r0, r1 = piece(hop, j)
        if hop >= world - 1 and wire == flat.dtype:
            return flat[r0:r1]
        offset = (hop % 2) * longest + slots[j][0]
        return scratch[offset:offset + r1 - r0]

    def post(hop: int, j: int, send: bool, recv: bool) -> list:
        """Post piece j of hop `hop`: its send right, its receive from the left (tag: the hop
        and piece, so a receive may wait posted long before its message comes); the works of
        the receive."""
        s0, s1 = piece(hop, j, sent=True)
        r0, r1 = piece(hop, j)
        out = flat[s0:s1].to(wire) if send and s1 > s0 else None
        into = target(hop, j) if recv and r1 > r0 else None
        if send:  # (a late sender thread, _LateSends, counts moved[0]; this thread moved[1])
            moved[0] += (s1 - s0) * itemsize
        if recv:
            moved[1] += (r1 - r0) * itemsize
        ops, works = post_exchange(out, right, into, left, group, tag=hop * pieces + j)
        if ordered:  # one batch: waited as the hop's
            kept.append((ops, []))
            return works
        if out is not None:  # the send is the last op, its work the last work
            kept[:] = still_sending(kept)
            kept.append((ops, works[-1:]))
            works = works[:-1]
        return works

    # Each piece's receives are posted two hops ahead (Gloo sends a message only once its
    # receive is posted: posted late, every hop waits a round trip of notices). A hop's
    # piece j moves on as soon as it has arrived and been summed. An injected latency on Gloo
    # holds each send back delay_s after its piece is ready, on a thread of its own, so that
    # it arrives delay_s plus its transfer later while the other pieces go on, as on a link
    # of that latency. (Gloo's receives say they are done only once waited, so one thread
    # cannot both wait for them and send on time.) NCCL's sends are batched with their hop's
    # receives, and there the delay is a pause before each hop, which overlaps the transfer.
    waiting: dict[tuple[int, int], list] = {}
    late = _LateSends(delay_s, lambda hop, j: post(hop, j, send=True, recv=False)) if delay_s and not ordered \
        else None
    pause = delay_s if late is None else 0.0  # NCCL's delay: before each hop

    def send(hop: int, j: int) -> None:
        if late is not None:
            late.send(hop, j)
        else:
            waiting[hop, j] = post(hop, j, send=True, recv=ordered) + waiting.get((hop, j), [])

    try:
        for j in range(pieces):
            for hop in range(first, first if ordered else min(first + 2, last)):
                waiting[hop, j] = post(hop, j, send=False, recv=True)
        for hop in range(first, last):
            if pause:
                time.sleep(pause)
            if hop == first:
                for j in range(pieces):
                    send(first, j)
            for j in range(pieces):
                for work in waiting.pop((hop, j)):
                    work.wait()
                r0, r1 = piece(hop, j)
                if r1 > r0:
                    into = target(hop, j)
                    if hop < world - 1:
                        flat[r0:r1] += into
                        if hop == world - 2 and wire != flat.dtype:  # the owned piece, as the others get it
                            flat[r0:r1] = flat[r0:r1].to(wire)
                    elif into.data_ptr() != flat[r0:r1].data_ptr():
                        flat[r0:r1] = into
                if not ordered and hop + 2 < last:
                    waiting[hop + 2, j] = post(hop + 2, j, send=False, recv=True)
                if hop + 1 < last:
                    send(hop + 1, j)
    except BaseException:
        if late is not None:
            late.close(drop=True)  # what is still held is not sent
        raise
    if late is not None:
        late.close()  # every held send posted; the first error one met raised
    for _, works in kept:
        for work in works:
            work.wait()
    return moved[0], moved[1]


class _LateSends:
    """Sends posted delay_s after they are asked for, in order, by a thread of their own
    (post(hop, piece) posts one); close() waits until every one asked for is posted and
    raises the first error a post met."""

    def __init__(self, delay_s: float, post: Callable[[int, int], list]) -> None:
        self.delay_s, self._post, self.error = delay_s, post, None
        self._drop = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="psar-ring-late-sends", daemon=True)
        self._thread.start()

    def send(self, hop: int, j: int) -> None:
        if self.error is not None:
            raise RuntimeError(f"ring: a held-back send failed: {self.error}") from self.error
        self._queue.put((time.monotonic() + self.delay_s, hop, j))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            when, hop, j = item
            if not self._drop.wait(max(0.0, when - time.monotonic())) and self.error is None:
                try:
                    self._post(hop, j)
                except Exception as e:  # raised in the ring's own thread, by send or close
                    self.error = e

    def close(self, drop: bool = False) -> None:
        if drop:
            self._drop.set()
        self._queue.put(None)
        self._thread.join()
        if self.error is not None and not drop:
            raise RuntimeError(f"ring: a held-back send failed: {self.error}") from self.error
