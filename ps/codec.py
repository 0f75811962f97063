"""compress.method on the parameter server: each key's message compressed, checked, rebuilt.

The compressor (experiments.compression, by shape: compress, decompress, forms, check) works
on one key's flat chunk at a time, named as every engine names it (`key_name`), so that its
shared randomness (random-k's indices, QSGD's rounding) is what the all-reduce engine draws
for the same parameter. Both ways:

- pushes: a worker adds its error-feedback residual to each key's gradient, compresses it and
  remembers what the message left out (ps.engine); the shard checks the frames against
  `forms` before a tensor is built (ps.protocol), then `check`s their contents and
  decompresses, summing in the parameters' dtype as for a dense push.
- pulls (sync; compress.pull), as BytePS sends its way back: once a key's step is complete
  the shard compresses the averaged gradient plus its own error-feedback residual, updates
  the key with what the message carries (its optimizer, as ever) and keeps the rest as the
  residual; every worker's reply is that one message, and each worker applies the same
  optimizer step to it (ps.engine), so its copy follows the shard's values bit for bit
  (tested). The final pull and checkpoints send the exact values. Memory: the residual, one
  copy of the shard's parameters; each worker keeps its optimizer's state (SGD's momentum:
  one copy of its model).
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


class GradientPulls:
    """A sync shard's compressed pulls: each update's averaged gradient, compressed with the
    shard's error feedback (see the module's docstring)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residual: dict[int, torch.Tensor] = {}  # key -> what the messages left out so far
        self._sent: dict[int, tuple[int, Packed]] = {}  # key -> (version it updated to, its message)

    def compress(self, k: int, grad: torch.Tensor, version: int) -> torch.Tensor:
        """What the update of key k to `version` applies in place of `grad` (flat): the
        compressed gradient plus residual; the rest becomes the residual."""
        residual = self.residual.get(k)
        compensated = grad if residual is None else grad + residual
        packed = self.codec.compress(k, compensated, version, SERVER_RANK)
        applied = self.codec.decompress(k, packed.frames, packed.meta)
        self.residual[k] = compensated - applied
        self._sent[k] = (version, packed)
        return applied

    def message(self, k: int, version: int) -> Packed:
        """The message of key k's update to `version` (the one every reply of it carries)."""
        made, packed = self._sent.get(k, (None, None))
        if made != version:
            raise RuntimeError(f"key {k}: a compressed pull of version {version}, but its last update "
                               f"made version {made}")
        return packed

    def reset(self) -> None:
        """The chunks were loaded (a checkpoint): what was left out belongs to another run."""
        self.residual, self._sent = {}, {}
