"""The values a shard's replies carry, and the buffers it reuses for them.

Replies leave zero-copy: a reply's frames point into a chunk, or into a snapshot of it in the
wire dtype (under compression) shared by every reply until the key's next update. So a chunk
is moved before it is written while a reply still points at it (own), a snapshot is never
written while a reply may point at it, and the former buffers are kept for reuse: a fresh
allocation of a large buffer costs its page faults on every update. The short path's replies
(ps.shard.fastpath) point into a chunk through a numpy view of it kept from one reply to the
next (reply_bytes), which whatever holds such a reply references, so own counts those too.
The compiled path (ps.shard.compiled) writes a chunk without asking torch who holds it: it
takes only keys whose kept view nothing else references and that no snapshot() reply was
given since own() last looked (`lent`).
"""

from __future__ import annotations

import sys

import numpy
import torch

from ps.protocol import as_array

SPARE_SNAPSHOTS = 4
"""Former buffers kept per key for reuse (snapshots in the wire dtype, and a chunk's former
memory while replies still point at it): on a slow link ZeroMQ still holds the replies of a
few updates back, and a fresh allocation of a large buffer costs its page faults on every
update (a shard's push+pull of 1 MiB took 590 us in a profile with one spare, 440 us with
kept buffers)."""


def in_use(t: torch.Tensor, kept: int = 0) -> bool:
    """Whether anything besides `t` (and `kept` views of it that the pool keeps) holds its
    memory: a reply built on it (frames that ZeroMQ has not sent yet, or a reader's tensors).
    A fresh allocation of a large snapshot costs page faults on every update (a 16 MiB clone
    took 2x a copy into a kept buffer); a kept buffer is written again only when nothing else
    can see it. Without torch's use count, every buffer counts as in use (a fresh copy each
    time)."""
    return _USE_COUNT is None or _USE_COUNT(t.untyped_storage()._cdata) > 2 + kept  # t's own, and this call's


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class SnapshotPool:
    """Snapshots of the chunks (flat, or (rows, dim)) {key: tensor} in `wire` (a torch dtype,
    None: no compression), and the spare buffers behind them. The chunks dict is the shard's
    own: own() replaces a chunk's memory in place (chunk.data), never the dict's entry."""

    def __init__(self, chunks: dict[int, torch.Tensor], wire: torch.dtype | None) -> None:
        self.chunks, self.wire = chunks, wire
        self._snap: dict[int, dict] = {}  # key -> {wire dtype: its values as of its last update}
        self._spare: dict[tuple, list[torch.Tensor]] = {}  # (key, wire dtype or None) -> former buffers
        self._arrays: dict[int, object] = {}  # key -> a numpy view of its chunk's bytes (reply_bytes), until it moves
        self.lent: set[int] = set()  # keys whose chunk a reply of snapshot() may still point at, until own() looks

    def snapshot(self, k: int, exact: bool = False) -> torch.Tensor:
        """The values of chunk k as of its last update, to leave in a reply: the chunk itself
        (flat), or under compression (unless exact) a copy in the wire dtype shared by every
        reply until the next update."""
        if exact or self.wire is None:
            # A view of its own (detach), so that the reply counts as a use of the memory (in_use).
            self.lent.add(k)
            flat = self.chunks[k].detach()
            return flat if flat.dim() == 1 else flat.reshape(-1)
        copies = self._snap.setdefault(k, {})
        if self.wire not in copies:
            flat = self.chunks[k].detach().reshape(-1)
            spare = self._take((k, self.wire))
            copies[self.wire] = spare.copy_(flat) if spare is not None else flat.to(self.wire)
        return copies[self.wire]

    def reply_bytes(self, k: int) -> memoryview:
        """The bytes of chunk k (flat) as they are, for a reply of the whole key without
        compression, as a view of a numpy view of the chunk made once a key and kept until
        the chunk moves (own): a reply costs no tensor call (a detach and a numpy view cost
        20 us on a core that has just slept). Each view of those bytes, and each made from
        it (ZeroMQ's frames, a reader's tensors), holds a reference to the numpy view, which
        own() counts."""
        array = self._arrays.get(k)
        if array is None:
            flat = self.chunks[k].detach()
            array = self._arrays[k] = as_array(flat if flat.dim() == 1 else flat.reshape(-1)).view(numpy.uint8)
        return memoryview(array)

    def own(self, k: int) -> bool:
        """Make chunk k's memory the shard's alone before it is written: if a reply still
        points at it (ZeroMQ has not sent it yet), the chunk moves to a copy (in a spare
        buffer) and the reply keeps the former memory; whether it moved. Under sync the next
        update of a key comes only after every worker has its values, so this copies only
        when a reply is late (async, ssp, a slow link)."""
        chunk, array = self.chunks[k], self._arrays.get(k)
        replied = array is not None and sys.getrefcount(array) > 3  # beyond the dict's, this name's, the call's
        self.lent.discard(k)  # looked at: either nothing else points at the chunk, or it moves to new memory
        if not replied and not in_use(chunk, kept=array is not None):
            return False
        self._arrays.pop(k, None)  # a reply keeps the array, and through it the former memory
        spare = self._take((k, None))
        moved = spare.copy_(chunk.detach()) if spare is not None else chunk.detach().clone()
        former = chunk.detach()  # keeps the memory the reply points at; a spare once it is sent
        chunk.data = moved  # the same tensor to the optimizer (its state is keyed by it)
        del moved
        self._keep((k, None), former)
        return True

    def updated(self, k: int) -> None:
        """Chunk k was written: its snapshots are out of date, their buffers become spares."""
        for wire, old in self._snap.pop(k, {}).items():
            self._keep((k, wire), old)

    def nbytes(self) -> int:
        """The bytes of the snapshots and spare buffers held now."""
        held = [t for copies in self._snap.values() for t in copies.values()]
        held += [t for spares in self._spare.values() for t in spares]
        return sum(t.numel() * t.element_size() for t in held)

    def clear(self) -> None:
        """Every chunk was written (a checkpoint loaded): no snapshot holds."""
        self._snap = {}

    def _keep(self, pool: tuple, buffer: torch.Tensor) -> None:
        spares = self._spare.setdefault(pool, [])
        if len(spares) < SPARE_SNAPSHOTS:
            spares.append(buffer)

    def _take(self, pool: tuple) -> torch.Tensor | None:
        """A buffer of pool no reply points at any more (the newest first), taken out of it."""
        spares = self._spare.get(pool, [])
        free = next((i for i in reversed(range(len(spares))) if not in_use(spares[i])), None)
        return spares.pop(free) if free is not None else None
