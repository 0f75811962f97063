"""The workers of a shard: who joined, who is heard from, who left or is lost (or rejoined in
a new process), their clocks.

A worker's clock on a shard is 1 + the last step whose keys it has all pushed there. A worker
that has not joined within timeout_s of the shard's start, or is silent for worker_timeout_s,
is lost.
"""

from __future__ import annotations

PARTIAL_STEPS = 64
"""Incomplete steps remembered per worker (async/ssp); older ones are forgotten."""


class Workers:
    """Workers 0..num_workers-1 of a shard of `num_keys` keys."""

    def __init__(self, num_workers: int, num_keys: int) -> None:
        self.ids = range(num_workers)
        self.num_keys = num_keys
        self.seen: dict[int, float] = {}  # joined worker -> last heard from
        self.joined: set[int] = set()  # every worker that ever joined
        self.left: set[int] = set()  # workers done with all their steps
        self.lost: dict[int, str] = {}  # worker -> why
        self.joining: set[int] = set()  # rejoined workers a sync step does not count in yet
        self.rejoined: set[int] = set()  # workers that joined again (a new process in a lost one's place)
        self.clocks = {w: 0 for w in self.ids}
        self._partial: dict[int, dict[int, set[int]]] = {w: {} for w in self.ids}  # worker -> step -> keys

    def live(self) -> set[int]:
        return set(self.ids) - set(self.lost) - self.left - self.joining

    def rejoin(self, w: int) -> None:
        """A new process in worker w's place: no longer lost; what its predecessor pushed of
        unfinished steps stays where it was summed, and its own pushes start afresh."""
        self.lost.pop(w, None)
        self.rejoined.add(w)
        self._partial[w] = {}

    @property
    def finished(self) -> bool:
        """Every worker has left or is lost: nothing more will come."""
        return len(self.left | set(self.lost)) == len(self.ids)

    def leave(self, w: int) -> None:
        self.left.add(w)
        self.seen.pop(w, None)  # no longer watched for liveness

    def lose(self, w: int, reason: str) -> None:
        self.lost[w] = reason
        self._partial[w] = {}

    def never_joined(self) -> list[int]:
        """Workers neither joined nor lost."""
        return [w for w in self.ids if w not in self.joined and w not in self.lost]

    def silent_for(self, now: float) -> list[tuple[int, float]]:
        """(worker, seconds since it was last heard from) of each joined worker still watched."""
        return [(w, now - seen) for w, seen in self.seen.items()]

    def pushed(self, w: int, step: int) -> set[int]:
        """The keys w has pushed of step."""
        return self._partial[w].get(step, set())

    def note_keys(self, w: int, step: int, keys: list[int]) -> bool:
        """Record keys pushed by w for step; True when that completes the step on this shard."""
        partial = self._partial[w]
        done = partial.setdefault(step, set())
        done.update(keys)
        if len(done) < self.num_keys:
            while len(partial) > PARTIAL_STEPS:  # a worker that never pushes some keys: bounded memory
                del partial[min(partial)]
            return False
        self.clocks[w] = step + 1
        self._partial[w] = {s: ks for s, ks in partial.items() if s > step}
        return True

    def slowest(self) -> tuple[int, int] | None:
        """(worker, clock) of the slowest live worker (the lowest id among equals); None if none."""
        live = self.live()
        if not live:
            return None
        w = min(live, key=lambda w: (self.clocks[w], w))
        return w, self.clocks[w]
