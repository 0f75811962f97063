"""compress.*: the one compression setting, and the compressor and memory it builds."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from experiments.compression.base import Compressor
    from experiments.compression.errorfeedback import ErrorFeedback

# The settings each method reads (error_feedback: every method but none).
READS = {"none": (), "fp16": ("error_feedback",), "bf16": ("error_feedback",),
         "topk": ("ratio", "error_feedback", "pull"), "randomk": ("ratio", "seed", "error_feedback", "pull"),
         "sign": ("error_feedback", "pull"), "qsgd": ("levels", "seed", "error_feedback", "pull"),
         "powersgd": ("rank", "start_step", "seed", "error_feedback")}


@dataclass(frozen=True)
class CompressConfig:
    """Gradient compression, the same for every engine."""

    method: str = "none"
    """none, fp16, bf16, topk, randomk, sign, qsgd or powersgd."""
    ratio: float = 0.01
    """topk, randomk: the fraction of entries sent, in (0, 1]; k = max(1, ceil(ratio * n))."""
    levels: int = 16
    """qsgd: quantization levels s >= 1 of |g| / ||g||, the norm of each bucket of 512 entries."""
    rank: int = 1
    """powersgd: the rank of the approximation, >= 1 (torch's matrix_approximation_rank)."""
    start_step: int = 10
    """powersgd: steps before it sent uncompressed (torch's start_powerSGD_iter)."""
    error_feedback: bool | None = None
    """None: on for the biased methods (topk, randomk, sign, powersgd), off for the casts and
    qsgd (unbiased)."""
    seed: int = 0
    """randomk, qsgd, powersgd: the seed of their shared (or per-worker) randomness."""
    pull: bool = True
    """ps-sync: pulls carry each update's averaged gradient compressed by the same method, with
    the shard's error feedback (one more copy of its parameters), and each worker steps its own
    optimizer on it; false: pulls carry the values whole. Pushes are compressed either way."""

    def __post_init__(self) -> None:
        if self.method not in READS:
            raise ValueError(f"compress.method={self.method!r}: expected one of {', '.join(READS)}")
        if not 0 < self.ratio <= 1:
            raise ValueError(f"compress.ratio={self.ratio}: must be in (0, 1]")
        if self.levels < 1:
            raise ValueError(f"compress.levels={self.levels}: must be >= 1")
        if self.rank < 1:
            raise ValueError(f"compress.rank={self.rank}: must be >= 1")
        if self.start_step < 0:
            raise ValueError(f"compress.start_step={self.start_step}: must be >= 0")

    def check(self) -> None:
        """Refuse a setting given a value that the method does not read (after every override
        is applied: they come one at a time, in any order)."""
        for f in fields(self):
            if f.name != "method" and f.name not in READS[self.method] \
                    and getattr(self, f.name) != f.default:
                raise ValueError(f"compress.{f.name}={getattr(self, f.name)!r}: compress.method="
                                 f"{self.method} does not read it (it reads: "
                                 f"{', '.join(READS[self.method]) or 'nothing'})")

    def build(self) -> tuple[Compressor, ErrorFeedback | None]:
        """The compressor, and an error-feedback memory where it is on (None where off)."""
        from experiments.compression.casts import bf16, fp16, none
        from experiments.compression.errorfeedback import ErrorFeedback
        from experiments.compression.powersgd import PowerSGD
        from experiments.compression.qsgd import QSGD
        from experiments.compression.randomk import RandomK
        from experiments.compression.sign import Sign
        from experiments.compression.topk import TopK

        compressor = {
            "none": none, "fp16": fp16, "bf16": bf16, "sign": Sign,
            "topk": lambda: TopK(self.ratio),
            "randomk": lambda: RandomK(self.ratio, self.seed),
            "qsgd": lambda: QSGD(self.levels, self.seed),
            "powersgd": lambda: PowerSGD(self.rank, self.start_step, self.seed),
        }[self.method]()
        on = compressor.needs_error_feedback if self.error_feedback is None else self.error_feedback
        return compressor, (ErrorFeedback() if on else None)
