"""The settings every process of a run must share, checked at each worker's join."""

from __future__ import annotations

from typing import Any

from ps.shard.reject import Reject


class SettingsCheck:
    """`mine`: {name: scalar} the shard `shard` runs with (None: nothing is checked). A
    setting the shard does not have (one only workers use) must equal the first joined
    worker's."""

    def __init__(self, shard: int, mine: dict[str, Any] | None) -> None:
        self.shard, self.mine = shard, mine
        self._first: tuple[int, dict[str, Any]] | None = None  # (worker, its settings)

    def check(self, w: int, theirs: dict[str, Any] | None) -> None:
        """Refuse (Reject) worker w's join if its settings differ, naming each."""
        if self.mine is None or theirs is None:
            return
        first_w, first = self._first or (w, theirs)
        diff = []
        for key in sorted(set(theirs) | set(self.mine) | set(first)):
            mine, who = (self.mine, f"shard {self.shard}") if key in self.mine else (first, f"worker {first_w}")
            a, b = theirs.get(key, "(unset)"), mine.get(key, "(unset)")
            if a != b:
                diff.append(f"{key}: worker {w} has {a!r}, {who} has {b!r}")
        if diff:
            raise Reject(f"worker {w} was started with other settings than the run's: {', '.join(diff)}; "
                         "start every process of a run with the same experiment, --steps, --seed and --set")
        self._first = self._first or (w, theirs)
