"""Settings of the sharded data-parallel engine zero (`--set zero.KEY=VALUE`)."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = (1, 2, 3)
ALGORITHMS = ("library", "ring")


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 1
    """ZeRO's stage: 1 shards the optimizer state, 2 the gradients too, 3 the parameters too
    (allreduce/zero.py, allreduce/zero_units.py)."""
    algorithm: str = "library"
    """'library': the backend's reduce-scatter and all-gather (Gloo on CPU, NCCL on CUDA);
    'ring': the two halves of psar's own ring (allreduce/ring.py), pipelined in pieces."""
    bucket_mb: float = 25.0
    """Parameter bytes per bucket (MiB): each is one buffer of which every rank owns 1/N, and
    its gradient is reduce-scattered as soon as backward has produced it."""
    first_bucket_mb: float = 1.0
    """Cap of the first bucket (the last layers'), small so communication starts early."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"zero.stage={self.stage!r}: expected one of {', '.join(map(str, STAGES))}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"zero.algorithm={self.algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
        if not self.bucket_mb > 0 or not self.first_bucket_mb > 0:
            raise ValueError(f"zero.bucket_mb={self.bucket_mb} and zero.first_bucket_mb={self.first_bucket_mb} "
                             "must both be > 0")
