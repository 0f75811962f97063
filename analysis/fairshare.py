"""Flows over shared links with max-min fair sharing: when each of a step's messages finishes,
where the closed forms of analysis/linkmodel.py only give the busiest link's bytes.

A flow is bytes that leave at `start` over a path of links (a host's way out, its rack's
uplink, the other host's way in) and arrive `latency` seconds after their last byte left.
While flows are under way, every link's capacity is shared max-min fairly among the flows
crossing it (progressive filling: the link that can give its flows the least freezes them at
that rate, which the other links then do without), as TCP flows on a switched network
roughly share it. Rates change only when a flow starts or ends, so the simulation steps from
one such event to the next: exact for this model, and fast enough for a step of 1024 workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.start < 0 or self.latency < 0:
            raise ValueError(f"flow {self.name!r}: nbytes={self.nbytes}, start={self.start} and "
                             f"latency={self.latency} must be >= 0")


def fair_rates(flows: Iterable[Flow], capacity: Mapping[str, float]) -> dict[str, float]:
    """Each flow's max-min fair rate (bytes/s) when exactly these flows are under way."""
    unfrozen = {f.name: f for f in flows}
    remaining = {link: float(capacity[link]) for f in unfrozen.values() for link in f.links}
    rates = {name: float("inf") for name, f in unfrozen.items() if not f.links}
    for name in rates:
        del unfrozen[name]
    while unfrozen:
        crossing: dict[str, list[str]] = {}
        for name, f in unfrozen.items():
            for link in f.links:
                crossing.setdefault(link, []).append(name)
        shares = {link: remaining[link] / len(names) for link, names in crossing.items()}
        least = min(shares.values())
        # every link that gives its flows no more than the least freezes them together
        frozen = {name for link, share in shares.items() if share <= least * (1 + 1e-12) for name in crossing[link]}
        for name in frozen:
            rates[name] = max(0.0, least)
            for other in unfrozen[name].links:
                remaining[other] -= rates[name]
            del unfrozen[name]
    return rates


def simulate(flows: Iterable[Flow], capacity: Mapping[str, float]) -> dict[str, float]:
    """The second each flow arrives, every flow's bytes moving at their max-min fair rate
    from its start to its end."""
    flows = list(flows)
    unknown = sorted({link for f in flows for link in f.links} - set(capacity))
    if unknown:
        raise ValueError(f"flows cross links with no capacity given: {', '.join(unknown)}")
    if any(capacity[link] <= 0 for f in flows for link in f.links):
        raise ValueError("every link a flow crosses needs a capacity > 0")
    if len({f.name for f in flows}) != len(flows):
        raise ValueError("flow names must be unique")
    pending = sorted(flows, key=lambda f: f.start)  # popped from the front: few distinct starts a step
    left: dict[str, float] = {}
    active: dict[str, Flow] = {}
    arrived: dict[str, float] = {}
    now = 0.0
    while pending or active:
        while pending and pending[0].start <= now + EPSILON:
            f = pending.pop(0)
            active[f.name], left[f.name] = f, f.nbytes
        for name in [n for n in active if left[n] <= EPSILON or not active[n].links]:
            arrived[name] = now + active.pop(name).latency
        if not active:
            if pending:
                now = pending[0].start
            continue
        rates = fair_rates(active.values(), capacity)
        finish = min(left[n] / rates[n] for n in active if rates[n] > 0)
        step = min(finish, pending[0].start - now) if pending else finish
        for name in active:
            left[name] -= rates[name] * step
        now += step
    return arrived
