"""Requests a shard answers later: pulls, waits and norms whose condition does not hold yet.

Each waits until its condition holds (answered then) or its deadline passes (an error naming
what it waited for); a final pull (wait_left) waits as long as the workers it waits for are
alive, which liveness bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ps.protocol import Message


@dataclass
class Waiter:
    peer: bytes
    msg: Message
    since: float
    deadline: float
    fields: dict = field(default_factory=dict)  # more of the reply's header


class Waiting:
    """The requests waiting, and how long the answered ones waited (stats)."""

    def __init__(self) -> None:
        self._waiting: list[Waiter] = []
        self.waits = dict(count=0, total_s=0.0, max_s=0.0)

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, peer: bytes, msg: Message, now: float, timeout_s: float, fields: dict) -> None:
        self._waiting.append(Waiter(peer, msg, now, now + timeout_s, fields))

    def ready(self, holds: Callable[[Message], bool], now: float,
              keys: set[int] | None = None) -> list[tuple[Waiter, float]]:
        """(waiter, seconds waited) of each request whose condition now holds, taken out.
        keys: only these keys were updated since the last look (a sync step under way), so a
        pull of keys that are all others cannot have become ready and is not asked about."""
        out = []
        if keys is None:
            found = [d for d in self._waiting if holds(d.msg)]
        else:
            found = [d for d in self._waiting if (d.msg.op != "pull" or not d.msg.keys
                                                  or not keys.isdisjoint(d.msg.keys)) and holds(d.msg)]
        if found:
            kept = set(map(id, found))
            self._waiting = [d for d in self._waiting if id(d) not in kept]
        for d in found:
            waited = now - d.since
            self.waits["count"] += 1
            self.waits["total_s"] += waited
            self.waits["max_s"] = max(self.waits["max_s"], waited)
            out.append((d, waited))
        return out

    def expired(self, now: float) -> list[Waiter]:
        """The requests past their deadline (a final pull has none), taken out."""
        out = [d for d in self._waiting if now >= d.deadline and not d.msg.get("wait_left")]
        for d in out:
            self._waiting.remove(d)
        return out

    def take_all(self) -> list[Waiter]:
        out, self._waiting = self._waiting, []
        return out
