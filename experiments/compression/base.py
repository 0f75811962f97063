"""The compressor interface: a method is a small object with compress, decompress and nbytes.

A Message is what crosses the wire: a few tensor frames (values, indices, scales, packed
bits) plus the plain integers a header carries (the original shape, a shared seed, k), so a
wire protocol sends it as one msgpack header and raw frames, never a pickle.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Context:
    """Where a tensor is being compressed: the seeds of shared and per-worker randomness."""

    step: int = 0
    """The optimizer step (random-k and PowerSGD draw afresh each step)."""
    key: str | int = 0
    """The tensor's name in the engine's layout (a parameter name or a key)."""
    rank: int = 0
    """This worker's rank (QSGD's rounding is per worker, so independent across workers)."""


@dataclass(frozen=True)
class Message:
    """One compressed tensor: the frames that cross the wire and the header that describes them."""

    frames: tuple[torch.Tensor, ...]
    """The tensors sent, in a fixed order per method (see each method's docstring)."""
    shape: tuple[int, ...]
    """The original tensor's shape."""
    dtype: torch.dtype
    """The original tensor's dtype (what decompress returns)."""
    header: tuple[int, ...] = field(default=())
    """Small integers sent in the header (random-k: its index seed and k); not counted in nbytes."""


class Compressor:
    """A compression method. Subclasses set the three class attributes and compress/decompress."""

    name: str = ""
    adds_up: bool = False
    """True when the sum of N workers' messages (frame by frame) is the message of their sum,
    so a ring can all-reduce the frames; False: a ring must all-gather them (bytes grow with N)."""
    needs_error_feedback: bool = False
    """Whether error feedback is on when the setting leaves it to the method (it is biased)."""

    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        raise NotImplementedError

    def decompress(self, message: Message) -> torch.Tensor:
        raise NotImplementedError

    def forms(self, shape: tuple[int, ...], dtype: torch.dtype, header: tuple[int, ...]) -> list[tuple]:
        """The (dtype, shape) of every frame of a message of a tensor of `shape` and `dtype`
        with this header, so that a receiver checks what a peer sent before it reads it.
        ValueError names a header this method would never send."""
        raise NotImplementedError

    def check(self, message: Message) -> None:
        """ValueError if the frames' contents could not have come from compress (an index out
        of range, a level above the method's): a peer's message is checked before decompress.
        The frames' dtypes and shapes are forms'; checked already."""

    def nbytes(self, message: Message) -> int:
        """Bytes on the wire: every frame's bytes (values, indices, scales, packed bits)."""
        return sum(t.numel() * t.element_size() for t in message.frames)


def sum_messages(compressor: Compressor, messages: list[Message]) -> Message:
    """What an all-reduce of the frames computes: frame-wise sums, in the frames' own dtype."""
    if not compressor.adds_up:
        raise ValueError(f"compress.method={compressor.name}: its messages do not add up; all-gather them")
    first = messages[0]
    for m in messages[1:]:
        if (m.header, m.shape, m.dtype) != (first.header, first.shape, first.dtype):
            raise ValueError(f"messages of {compressor.name} disagree on header/shape/dtype: "
                             f"{m.header, m.shape, m.dtype} != {first.header, first.shape, first.dtype}")
    frames = tuple(torch.stack([m.frames[i] for m in messages]).sum(0)
                   for i in range(len(first.frames)))
    return Message(frames, first.shape, first.dtype, first.header)


def expect_header(method: str, header: tuple[int, ...], expected: tuple[int, ...] | int) -> None:
    """ValueError unless header is `expected` (a tuple), or holds `expected` ints (an int)."""
    ok = len(header) == expected if isinstance(expected, int) else tuple(header) == expected
    if not ok or any(type(h) is not int for h in header):
        raise ValueError(f"{method}: message header {list(header)}; expected "
                         + (f"{expected} ints" if isinstance(expected, int) else f"{list(expected)}"))


def seed_for(*parts: object) -> int:
    """A 63-bit seed from (seed, step, key, ...): the same on every machine and Python run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(seed_for(*parts))


def count(ratio: float, n: int) -> int:
    """k = max(1, ceil(ratio * n)), with ratio * n rounded to 9 places first (0.07 * 100 is 7, not 8)."""
    return max(1, min(n, math.ceil(round(ratio * n, 9))))


def index_dtype(n: int) -> torch.dtype:
    """int32 indices where they fit, int64 beyond 2**31 - 1 elements."""
    return torch.int32 if n <= 2**31 - 1 else torch.int64
