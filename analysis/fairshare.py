"""Flows over shared links with max-min fair sharing: when each of a step's messages finishes,
where the closed forms of analysis/linkmodel.py only give the busiest link's bytes.

A flow is bytes that leave at `start` over a path of links (a host's way out, its rack's
uplink, the other host's way in) and arrive `latency` seconds after their last byte left.
While flows are under way, every link's capacity is shared max-min fairly among the flows
crossing it (progressive filling: the link that can give its flows the least freezes them at
that rate, which the other links then do without), as TCP flows on a switched network
roughly share it. Rates change only when a flow starts or ends, so the simulation steps from
one such event to the next: exact for this model, and fast enough for a step of 1024 workers.

Two additions let a schedule be played as it runs, at any scale:

- a flow may stand for a class of identical flows (every worker's push of one key to one
  shard): its `fan` says, for each link it names, how many of the class's flows cross one
  such link (a worker's way out: 1; the shard's way in: N), and the link stands for every link
  like it. Max-min fair sharing of identical flows gives them identical rates, so the class
  moves as one flow does, with each link's load counted by its fan.
- `then(name, at)`, given to simulate(), is asked for the flows that a flow's end lets start:
  at its arrival (a shard's reply once every worker's push of the key is in), or as soon as
  its last byte left, `at` less its latency (the next message on the same connection).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

EPSILON = 1e-9
"""Bytes below which a flow counts as done (float rounding of rate x time)."""


@dataclass(frozen=True)
class Flow:
    name: str
    links: tuple[str, ...]
    """The links it crosses, each named as in the capacities given to simulate()."""
    nbytes: float
    start: float = 0.0
    """Seconds after the step began when its first byte may leave."""
    latency: float = 0.0
    """Seconds from its last byte leaving to its arrival (propagation, the receiver's work)."""
    fan: tuple[float, ...] = ()
    """For a flow that stands for a class of identical flows, how many of them cross one of
    each of its links (in the order of `links`); (): one each."""
    priority: float = 0.0
    """Where links serve their flows first come, first served (priority_rates): the lower,
    the sooner."""

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.start < 0 or self.latency < 0:
            raise ValueError(f"flow {self.name!r}: nbytes={self.nbytes}, start={self.start} and "
                             f"latency={self.latency} must be >= 0")
        if self.fan and (len(self.fan) != len(self.links) or min(self.fan) <= 0):
            raise ValueError(f"flow {self.name!r}: fan {self.fan} needs one count > 0 per link {self.links}")

    def load(self) -> Iterable[tuple[str, float]]:
        """(link, flows of its class on one such link) for each link it crosses."""
        return zip(self.links, self.fan or (1.0,) * len(self.links))


def fair_rates(flows: Iterable[Flow], capacity: Mapping[str, float]) -> dict[str, float]:
    """Each flow's max-min fair rate (bytes/s) when exactly these flows are under way."""
    unfrozen = {f.name: f for f in flows}
    remaining = {link: float(capacity[link]) for f in unfrozen.values() for link in f.links}
    rates = {name: float("inf") for name, f in unfrozen.items() if not f.links}
    for name in rates:
        del unfrozen[name]
    while unfrozen:
        crossing: dict[str, list[str]] = {}
        flows_on: dict[str, float] = {}
        for name, f in unfrozen.items():
            for link, fan in f.load():
                crossing.setdefault(link, []).append(name)
                flows_on[link] = flows_on.get(link, 0.0) + fan
        shares = {link: remaining[link] / flows_on[link] for link in crossing}
        least = min(shares.values())
        # every link that gives its flows no more than the least freezes them together
        frozen = {name for link, share in shares.items() if share <= least * (1 + 1e-12) for name in crossing[link]}
        for name in frozen:
            rates[name] = max(0.0, least)
            for other, fan in unfrozen[name].load():
                remaining[other] -= rates[name] * fan
            del unfrozen[name]
    return rates


def priority_rates(flows: Iterable[Flow], capacity: Mapping[str, float]) -> dict[str, float]:
    """Each flow's rate when every link serves its flows in order of priority (ties: as
    given): a flow takes what its links have left, the next ones what it leaves (a host's
    queue, first in first out, whose first message held back elsewhere lets the next ones
    use the link)."""
    remaining: dict[str, float] = {}
    rates = {}
    for f in sorted(flows, key=lambda f: f.priority):
        loads = list(f.load())
        rate = min((remaining.get(link, capacity[link]) / fan for link, fan in loads), default=float("inf"))
        rates[f.name] = max(0.0, rate)
        for link, fan in loads:
            remaining[link] = remaining.get(link, capacity[link]) - rates[f.name] * fan
    return rates


def _checked(flows: list[Flow], capacity: Mapping[str, float], known: set[str]) -> list[Flow]:
    unknown = sorted({link for f in flows for link in f.links} - set(capacity))
    if unknown:
        raise ValueError(f"flows cross links with no capacity given: {', '.join(unknown)}")
    if any(capacity[link] <= 0 for f in flows for link in f.links):
        raise ValueError("every link a flow crosses needs a capacity > 0")
    names = [f.name for f in flows]
    if len(set(names)) != len(names) or known.intersection(names):
        raise ValueError("flow names must be unique")
    known.update(names)
    return flows


def simulate(flows: Iterable[Flow], capacity: Mapping[str, float],
             then: Callable[[str, float], Iterable[Flow]] | None = None,
             share: Callable[[Iterable[Flow], Mapping[str, float]], dict[str, float]] = fair_rates) -> dict[str, float]:
    """The second each flow arrives, every flow's bytes moving at the rate `share` gives it
    (max-min fair by default; priority_rates) from its start to its end; then(name, at): the
    flows that flow name's arrival at `at` starts (none before its last byte left)."""
    known: set[str] = set()
    pending = sorted(_checked(list(flows), capacity, known), key=lambda f: f.start)
    left: dict[str, float] = {}
    active: dict[str, Flow] = {}
    arrived: dict[str, float] = {}
    now = 0.0
    while pending or active:
        while pending and pending[0].start <= now + EPSILON:
            f = pending.pop(0)
            active[f.name], left[f.name] = f, f.nbytes
        for name in [n for n in active if left[n] <= EPSILON or not active[n].links]:
            at = arrived[name] = now + active.pop(name).latency
            started = _checked(list(then(name, at)), capacity, known) if then is not None else []
            if any(f.start < now - EPSILON for f in started):
                raise ValueError(f"a flow that {name}'s end starts cannot leave before {name}'s last byte, at {now}")
            if started:
                pending = sorted(pending + started, key=lambda f: f.start)
        if pending and pending[0].start <= now + EPSILON:
            continue  # flows an arrival started now join before the rates are shared
        if not active:
            if pending:
                now = pending[0].start
            continue
        rates = share(active.values(), capacity)
        finish = min(left[n] / rates[n] for n in active if rates[n] > 0)
        step = min(finish, pending[0].start - now) if pending else finish
        for name in active:
            left[name] -= rates[name] * step
        now += step
    return arrived
