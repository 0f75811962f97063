"""Settings of the bucketed all-reduce engine (`--set allreduce.KEY=VALUE`)."""

from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("library", "ring", "halving-doubling", "tree", "hierarchical", "auto")
COMPRESSIONS = ("none", "fp16", "bf16")
UNUSED_POLICIES = ("error", "zero")
SPARSE_MODES = ("dense", "allgather")
OUTER_STEPS = ("none", "nesterov")


@dataclass(frozen=True)
class AllReduceConfig:
    algorithm: str = "library"
    """'library': the backend's own all-reduce (NCCL on CUDA, Gloo on CPU); 'ring': ours;
    'halving-doubling': ours, 2 log2 N steps (allreduce/halving.py); 'tree': ours, a binomial
    tree's reduce then broadcast of the whole tensor (allreduce/tree.py); 'hierarchical': ours,
    inside each rack (net.racks; without racks, each host), then across the racks, then back
    inside (allreduce/hierarchical.py); 'auto': per bucket, whichever of ours the alpha-beta
    model predicts fastest on the run's links and racks (allreduce/auto.py)."""
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
    period: int = 1
    """Local SGD: 1 all-reduces the gradients every step; H > 1 lets each worker step its
    optimizer on its own gradients and averages the parameters every H steps (torch's
    PeriodicModelAverager, with post_localSGD_hook before that)."""
    period_warmup: int = 0
    """Local SGD (period > 1): the first W steps all-reduce the gradients as period 1 does;
    the parameters are then averaged at steps W, W + H, W + 2H, ... (post-local SGD)."""
    outer: str = "none"
    """Local SGD's outer step (period > 1): 'none' makes the workers' mean the model;
    'nesterov' is DiLoCo (Douillard et al. 2023): the mean change of the workers' models since
    the last averaging is the outer gradient of a Nesterov SGD step on the model they share,
    which every worker then starts the next period from."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""

    def __post_init__(self) -> None:
        _choice("allreduce.outer", self.outer, OUTER_STEPS)
        if not self.outer_lr > 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"allreduce.outer_lr={self.outer_lr} must be > 0 and allreduce.outer_momentum="
                             f"{self.outer_momentum} in [0, 1)")
        if type(self.period) is not int or self.period < 1:
            raise ValueError(f"allreduce.period={self.period!r}: must be an int >= 1 (1: every step)")
        if type(self.period_warmup) is not int or self.period_warmup < 0:
            raise ValueError(f"allreduce.period_warmup={self.period_warmup!r}: must be an int >= 0")

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
