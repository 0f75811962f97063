"""Faults injected on purpose, to show how each engine copes with a straggler, a pause and
the loss of a worker (experiments/harness/inject.py carries them out)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultConfig:
    slow_rank: int = -1
    """Rank whose compute is slowed down (-1: none)."""
    slow_factor: float = 1.0
    """That rank's forward+backward takes this many times as long as its steps took before the
    slowdown began (it sleeps the difference; experiments/harness/inject.py)."""
    delay_ms: float = 0.0
    """One-way latency added to every message: each step of our ring (zero's too, with
    zero.algorithm=ring: N-1 a reduce-scatter or all-gather), 2(N-1) of them before each
    library all-reduce, two (request and reply) on every parameter-server round trip, one on
    each of gossip's models (they leave that late) and two on each of AD-PSGD's averages."""

    kill_rank: int = -1
    """Rank that dies (SIGKILL, no goodbye) before the compute of step kill_step (-1: none);
    on the job's first attempt only, so that a restarted job runs through."""
    kill_step: int = 0
    """The step at whose start kill_rank dies (the first it runs from this one on)."""
    pause_rank: int = -1
    """Rank whose process stops, every thread of it (SIGSTOP, as a preempted VM or a
    stop-the-world pause), for pause_s seconds once, at the start of step pause_step (-1: none)."""
    pause_step: int = 0
    """The step at whose start pause_rank stops (the first it runs from this one on)."""
    pause_s: float = 0.0
    """How long pause_rank stays stopped."""

    def __post_init__(self) -> None:
        for name in ("kill_rank", "pause_rank"):
            if getattr(self, name) < -1:
                raise ValueError(f"fault.{name}={getattr(self, name)}: a rank, or -1 for none")
        for name in ("kill_step", "pause_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"fault.{name}={getattr(self, name)}: must be >= 0")
        if not 0 <= self.pause_s < 3600:
            raise ValueError(f"fault.pause_s={self.pause_s}: seconds, >= 0 and below an hour")
        if self.slow_factor < 1.0:
            raise ValueError(f"fault.slow_factor={self.slow_factor}: must be >= 1")
        if self.slow_rank < -1:
            raise ValueError(f"fault.slow_rank={self.slow_rank}: a rank, or -1 for none")
        if self.delay_ms < 0:
            raise ValueError(f"fault.delay_ms={self.delay_ms}: must be >= 0")

    @property
    def delay_s(self) -> float:
        return self.delay_ms / 1000.0

    def kills(self, rank: int, step: int) -> bool:
        """Whether rank dies at the start of step (the first it runs from kill_step on)."""
        return rank == self.kill_rank and step >= self.kill_step

    def pauses(self, rank: int, step: int) -> bool:
        """Whether rank stops at the start of step (the first it runs from pause_step on)."""
        return rank == self.pause_rank and step >= self.pause_step and self.pause_s > 0
