"""A one-line progress bar for rank 0 on a terminal; silent anywhere else."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, enabled: bool, label: str = "", stream=None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.label = total, label
        self.enabled = enabled and self.stream.isatty()
        self._start = time.perf_counter()
        self._last = 0.0

    def update(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < self.total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * done // self.total
        rate = done / (now - self._start) if now > self._start else 0.0
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
            f"loss {loss:.4f} {rate:.1f} steps/s"
        )
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()
