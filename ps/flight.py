"""What a PSClient hands back: the Handle of a request in flight on one or more shards, the
Result its replies make, and PSError for a shard's refusal or a reply that does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ps.protocol import Message


class PSError(RuntimeError):
    """A server answered with an error, or sent something that does not fit the protocol.
    code: the error reply's code (ps.protocol.ERROR_CODES), None where it has none."""

    def __init__(self, text: str, code: str | None = None) -> None:
        super().__init__(text)
        self.code = code


@dataclass
class Handle:
    """An operation in flight on one or more shards; pass it to PSClient.wait."""

    kind: str
    pending: dict[int, int] = field(default_factory=dict)  # request id -> shard
    replies: dict[int, Message] = field(default_factory=dict)  # shard -> reply
    error: Exception | None = None
    timeout_s: float = 60.0
    keep: list = field(default_factory=list, repr=False)  # sent tensors stay alive until the replies
    done_at: float = 0.0  # wall time (time.time) the last reply was read

    @property
    def done(self) -> bool:
        return not self.pending or self.error is not None


@dataclass
class Result:
    """What PSClient.wait gives for every kind of request: what its shards' replies carry
    (fields a kind's replies do not carry keep their empty defaults)."""

    kind: str
    """The request: "push", "push+pull", "pull", "wait", "norm", "stats", "checkpoint", ..."""
    version: int = 0
    """The smallest version over the shards that answered (0 where none names one)."""
    versions: dict[int, int] = field(default_factory=dict)
    """shard -> the version its reply names (of the values it sent, for a pull)."""
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    """key id -> flat chunk (built on the received frame, no copy): pull, push+pull, checkpoint."""
    waited_s: float = 0.0
    """Longest time a shard held the answer back for its condition (waiting for other workers)."""
    ids: dict[int, torch.Tensor] = field(default_factory=dict)
    """key id -> the row ids whose values `values` holds ((n, dim)), for keys pulled by rows."""
    staleness: int = 0
    """Of a push or push+pull: the largest staleness the shards reported for the push."""
    sq: dict[int, float] = field(default_factory=dict)
    """Of a norm: shard -> the sum of squares of its averaged gradient of the held step."""
    bodies: dict[int, Any] = field(default_factory=dict)
    """shard -> the body its reply carries (stats: its counters)."""
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """key id -> under compressed pulls, the gradient the shard's update applied
    (decompressed, flat), for this worker to apply the same optimizer step to (ps.codec)."""
