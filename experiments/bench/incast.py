"""Several hosts sending into one host's port at once (a parameter server's pushes into a
shard), on emulated links, under each TCP congestion control the emulated hosts may run:
what each round takes against the port's own time for its bytes, and how much TCP sent again.
It is why net.congestion defaults to a loss-based control (experiments/settings/net.py):
flows that ignore loss overflow a shallow port. `psar bench` runs it as root
(incast_if_possible)."""

from __future__ import annotations

from statistics import median
from typing import Callable

from experiments.settings.net import NetConfig, parse_rate

INCAST_SENDERS = 4
"""Senders into the one port: 4 workers' pushes into one of 4 separate shards."""
INCAST_BYTES = 270_000
"""Bytes each sender sends a round: a quarter of mlp-mid [256,256]'s gradient (1.08 MB)."""
INCAST_RATE = "100mbit"
INCAST_ROUNDS = 30
INCAST_GAP_S = 0.05
"""Idle between one round's end and the next one's start: a step's compute."""


def incast(congestion: str, rate: str = INCAST_RATE, senders: int = INCAST_SENDERS, nbytes: int = INCAST_BYTES,
           rounds: int = INCAST_ROUNDS, gap_s: float = INCAST_GAP_S) -> dict:
    """`senders` hosts each sending nbytes at once into one host's port of `rate`, `rounds`
    rounds, each gap_s after the last one ended (needs root): the median and the slowest
    tenth's round (the first left out: it opens the flows' windows) against the port's own time
    for the bytes (senders * nbytes at the rate), the share of segments sent again and the
    retransmission timeouts, all hosts together."""
    from experiments.runtime.launcher import free_port
    from experiments.runtime.netns import Network, tcp_totals

    if rounds < 2:
        raise ValueError(f"incast: rounds={rounds}, need 2 or more (the first is left out)")
    port_s = senders * nbytes * 8 / parse_rate(rate)
    names = ("r", *(f"s{i}" for i in range(senders)))
    with Network(names, rate=rate, congestion=congestion) as net:
        seconds = net.incast("r", nbytes, free_port(), rounds, gap_s)
        tcp = [h.tcp_counters() for h in net.hosts.values()]
        ran = net.describe()["congestion"]
    seconds = sorted(seconds[1:])
    tenth = seconds[-max(1, len(seconds) // 10):]
    return {"congestion": ran, "rate": rate, "senders": senders, "bytes": nbytes, "gap_s": gap_s,
            "port_s": port_s, "median_x": median(seconds) / port_s, "slowest_tenth_x": median(tenth) / port_s,
            **tcp_totals(tcp), "seconds": seconds}


def incast_table(congestions: tuple[str, ...] = (NetConfig.congestion, "bbr"),
                 echo: Callable[[str], None] = print) -> list[dict]:
    """incast() under each of `congestions` (net.congestion's default and bbr) this machine
    lets the hosts run, alternated over two runs each; one that it does not allow is said
    (echo) and left out."""
    from experiments.runtime.iproute import CongestionRefused

    rows, refused = [], set()
    for _ in range(2):
        for name in congestions:
            if name in refused:
                continue
            try:
                rows.append(incast(name))
            except CongestionRefused as err:
                refused.add(name)
                echo(f"incast: {name} not measured: {err}")
    return rows


def format_incast_table(rows: list[dict]) -> str:
    if not rows:
        return "incast: no congestion control measured"
    first = rows[0]
    lines = [f"incast: {first['senders']} hosts sending {first['bytes'] / 1e3:.0f} KB each at once into one host's "
             f"{first['rate']} port, {len(first['seconds']) + 1} rounds "
             f"{1e3 * first['gap_s']:g} ms apart (the first left out); a round "
             f"against the port's own {1e3 * first['port_s']:.1f} ms",
             f"{'congestion':12s} {'median':>7s} {'slowest 10%':>12s} {'sent again':>11s} {'timeouts':>9s}"]
    for r in rows:
        lines.append(f"{r['congestion']:12s} {r['median_x']:6.2f}x {r['slowest_tenth_x']:11.2f}x "
                     f"{100 * r['retransmitted']:10.2f}% {r['timeouts']:9d}")
    return "\n".join(lines)


def incast_if_possible(echo: Callable[[str], None] = print) -> list[dict] | None:
    """incast_table() where emulated hosts can be made here (`psar bench` as root), echoed;
    else None, with why."""
    from experiments.runtime.iproute import unavailable

    why = unavailable()
    if why is not None:
        echo(f"incast: not measured ({why})")
        return None
    rows = incast_table(echo=echo)
    echo(format_incast_table(rows))
    return rows
