"""compress.method on the parameter server: each key's message compressed, checked, rebuilt.

The compressor (experiments.compression, by shape: compress, decompress, forms, check) works
on one key's flat chunk at a time, named as every engine names it (`key_name`), so that its
shared randomness (random-k's indices, QSGD's rounding) is what the all-reduce engine draws
for the same parameter. Both ways:

- pushes: a worker adds its error-feedback residual to each key's gradient, compresses it and
  remembers what the message left out (ps.engine); the shard checks the frames against
  `forms` before a tensor is built (ps.protocol), then `check`s their contents and
  decompresses, summing in the parameters' dtype as for a dense push.
- pulls (sync; compress.pull): the shard keeps `DeltaPulls.replica`, the values every worker
  holds. A key's reply after an update is the compressed change `chunk - replica`, computed
  once per update and shared by every worker's reply; the replica then adds what the message
  carries, so that what compression left out stays in `chunk - replica` and leaves with the
  next pull (the shard's error feedback, kept for free in the difference). A worker adds the
  decompressed change to its copy, which therefore equals the replica bit for bit. A join
  gets the replica, so a worker that joins late holds what the others hold; the final pull
  and checkpoints get the exact values. Shard memory: one more copy of its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ps.layout import Layout

SERVER_RANK = 1 << 20
"""The rank in a shard's compression context (QSGD's rounding): apart from every worker's."""


@dataclass(frozen=True)
class Packed:
    """One key's compressed message as it crosses the wire: its frames and header ints."""

    frames: tuple[torch.Tensor, ...]
    meta: tuple[int, ...]


class _Context:
    """experiments.compression.Context, by shape."""

    def __init__(self, step: int, key: str, rank: int) -> None:
        self.step, self.key, self.rank = step, key, rank


class _Message:
    """experiments.compression.Message, by shape: frames rebuilt from the wire."""

    def __init__(self, frames: Sequence[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
                 header: tuple[int, ...]) -> None:
        self.frames, self.shape, self.dtype, self.header = tuple(frames), shape, dtype, tuple(header)


def key_name(layout: Layout, k: int) -> str:
    """The name compression seeds key k's randomness with: its parameter's name where the key
    is the whole parameter (as an all-reduce bucket of that one parameter is), else the name
    with the key's span, `name[lo:hi]`."""
    key = layout.keys[k]
    spec = layout.specs[key.param]
    if key.offset == 0 and key.numel == spec.numel:
        return spec.name
    return f"{spec.name}[{key.offset}:{key.offset + key.numel}]"


class Codec:
    """compressor over the keys of layout: what ps.protocol checks frames against, and the
    compress / decompress of one key's flat chunk."""

    def __init__(self, compressor: Any, layout: Layout) -> None:
        if not hasattr(compressor, "forms"):
            raise ValueError(f"compress.method={compressor.name} does not run on a parameter server")
        self.compressor, self.layout = compressor, layout
        self.names = [key_name(layout, k) for k in range(len(layout.keys))]
        self._dtypes = [layout.dtype(key) for key in layout.keys]

    @property
    def name(self) -> str:
        return self.compressor.name

    def _like(self, k: int) -> tuple[tuple[int, ...], torch.dtype]:
        return (self.layout.keys[k].numel,), getattr(torch, self._dtypes[k])

    def forms(self, k: int, meta: tuple[int, ...]) -> list[tuple[str, list[int]]]:
        """(dtype name, shape) of each frame of key k's message with header `meta`."""
        shape, dtype = self._like(k)
        return [(str(d).removeprefix("torch."), list(s)) for d, s in self.compressor.forms(shape, dtype, meta)]

    def compress(self, k: int, flat: torch.Tensor, step: int, rank: int) -> Packed:
        message = self.compressor.compress(flat, _Context(step, self.names[k], rank))
        return Packed(tuple(f.contiguous() for f in message.frames), tuple(message.header))

    def decompress(self, k: int, frames: Sequence[torch.Tensor], meta: Sequence[int]) -> torch.Tensor:
        """Key k's flat tensor (a new one) from its frames; ValueError naming what compress
        never makes (check). The frames' forms were checked when they were decoded."""
        shape, dtype = self._like(k)
        message = _Message(frames, shape, dtype, tuple(meta))
        self.compressor.check(message)
        return self.compressor.decompress(message).reshape(-1)

    def nbytes(self, packed: Packed) -> int:
        return sum(f.numel() * f.element_size() for f in packed.frames)


class DeltaPulls:
    """A sync shard's compressed pulls: the replica of its chunks every worker holds, and the
    compressed change since it, once per update of a key (see the module's docstring)."""

    def __init__(self, codec: Codec, chunks: dict[int, torch.Tensor]) -> None:
        self.codec, self.chunks = codec, chunks
        self.replica = {k: t.detach().reshape(-1).clone() for k, t in chunks.items()}
        self._sent: dict[int, Packed] = {}  # key -> the change sent since its last update

    def message(self, k: int, step: int) -> Packed:
        """Key k's change since what workers hold, compressed; the same for every reply
        until its next update."""
        packed = self._sent.get(k)
        if packed is None:
            replica = self.replica[k]
            change = self.chunks[k].detach().reshape(-1) - replica
            packed = self._sent[k] = self.codec.compress(k, change, step, SERVER_RANK)
            replica.add_(self.codec.decompress(k, packed.frames, packed.meta))
        return packed

    def updated(self, k: int) -> None:
        self._sent.pop(k, None)

    def reset(self) -> None:
        """The chunks were loaded (a checkpoint): every worker joins again and gets them."""
        self.replica = {k: t.detach().reshape(-1).clone() for k, t in self.chunks.items()}
        self._sent = {}
