"""Log lines that a peer can cause by the thousand (malformed messages, refused handshakes,
replies to peers gone, refused requests) at most once per interval for each kind: the first
of a kind is logged, the ones within the interval after it are counted, and the next line of
that kind says how many were left out. A hostile or broken peer cannot fill the disk."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

INTERVAL_S = 5.0
MAX_KINDS = 256
"""Kinds remembered at most (a kind is a short reason, not a peer); past it the oldest go."""


class Throttle:
    """logger's lines, at most one per interval_s for each kind (any hashable)."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._kinds: dict[Any, tuple[float, int]] = {}  # kind -> (last logged, left out since)

    def log(self, level: int, kind: Any, msg: str, *args: Any) -> bool:
        """Log msg % args unless a line of this kind went out less than interval_s ago (then
        count it); True if it was logged."""
        now = self.clock()
        logged_at, unsaid = self._kinds.get(kind, (float("-inf"), 0))
        if now - logged_at < self.interval_s:
            self._kinds[kind] = (logged_at, unsaid + 1)
            return False
        if kind not in self._kinds and len(self._kinds) >= MAX_KINDS:
            del self._kinds[next(iter(self._kinds))]
        self._kinds.pop(kind, None)
        self._kinds[kind] = (now, 0)
        self.logger.log(level, msg + "%s", *args,
                        f" (and {unsaid} more like it in the last {now - logged_at:.0f} s)" if unsaid else "")
        return True
