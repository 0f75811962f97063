"""A one-line progress bar for rank 0 on a terminal; silent anywhere else."""

from __future__ import annotations

import sys
import time


class Progress:
    """total: the steps to run; None (a script's loop): the bar shows the count alone."""

    def __init__(self, total: int | None, enabled: bool, label: str = "", stream=None) -> None:
        self.stream = stream or sys.stderr
        self.total, self.label = total, label
        self.enabled = enabled and self.stream.isatty()
        self._start = time.perf_counter()
        self._last = 0.0

    def update(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        finished = self.total is not None and done >= self.total
        if not finished and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        rate = done / (now - self._start) if now > self._start else 0.0
        if self.total is None:
            bar = f"step {done}"
        else:
            filled = width * done // self.total
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
        self.stream.write(f"\r{self.label} {bar} loss {loss:.4f} {rate:.1f} steps/s")
        if finished:
            self.stream.write("\n")
        self.stream.flush()
