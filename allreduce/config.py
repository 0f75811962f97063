"""Settings of the bucketed all-reduce engine (`--set allreduce.KEY=VALUE`)."""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("library", "ring")
COMPRESSIONS = ("none", "fp16", "bf16")
UNUSED_POLICIES = ("error", "zero")
SPARSE_MODES = ("dense", "allgather")


@dataclass(frozen=True)
class AllReduceConfig:
    algorithm: str = "library"
    """'library': the backend's own all-reduce (NCCL on CUDA, Gloo on CPU); 'ring': ours."""
    bucket_cap_mb: float = 25.0
    """Gradient bytes per bucket (MiB); a bucket's all-reduce starts as soon as it is full."""
    first_bucket_mb: float = 1.0
    """Cap of the first bucket (the last layers' gradients), small so communication starts early."""
    compression: str = "none"
    """Wire dtype of gradients: 'none', 'fp16' or 'bf16' (averaged before the cast)."""
    unused: str = "error"
    """A parameter that got no gradient in a step: 'error' names it; 'zero' reduces zeros for it."""
    sparse: str = "dense"
    """Embedding tables: 'dense' densifies their gradients and all-reduces them in the buckets
    (as DDP does); 'allgather' has each worker all-gather the row ids and rows its batch
    touched (as Horovod does for sparse tensors), then updates only those rows."""

    def __post_init__(self) -> None:
        _choice("allreduce.algorithm", self.algorithm, ALGORITHMS)
        _choice("allreduce.compression", self.compression, COMPRESSIONS)
        _choice("allreduce.unused", self.unused, UNUSED_POLICIES)
        _choice("allreduce.sparse", self.sparse, SPARSE_MODES)
        if not self.bucket_cap_mb > 0 or not self.first_bucket_mb > 0:
            raise ValueError(
                f"allreduce.bucket_cap_mb={self.bucket_cap_mb} and allreduce.first_bucket_mb="
                f"{self.first_bucket_mb} must both be > 0"
            )


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: expected one of {', '.join(allowed)}")
