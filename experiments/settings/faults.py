"""Faults injected on purpose, to show how each engine copes with a straggler."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultConfig:
    slow_rank: int = -1
    """Rank whose compute is slowed down (-1: none)."""
    slow_factor: float = 1.0
    """That rank's forward+backward takes this many times as long (it sleeps the difference)."""
    delay_ms: float = 0.0
    """One-way latency added to every message: each step of our ring, 2(N-1) of them before
    each library all-reduce, and two (request and reply) on every parameter-server round trip."""

    def __post_init__(self) -> None:
        if self.slow_factor < 1.0:
            raise ValueError(f"fault.slow_factor={self.slow_factor}: must be >= 1")
        if self.slow_rank < -1:
            raise ValueError(f"fault.slow_rank={self.slow_rank}: a rank, or -1 for none")
        if self.delay_ms < 0:
            raise ValueError(f"fault.delay_ms={self.delay_ms}: must be >= 0")

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0

    def stall(self, rank: int, compute_s: float) -> None:
        """Called before each step's compute with the last step's compute time; the slow rank
        sleeps (slow_factor - 1) times it, so its compute takes slow_factor times as long."""
        if rank == self.slow_rank and self.slow_factor > 1.0:
            time.sleep((self.slow_factor - 1.0) * compute_s)
