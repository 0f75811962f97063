"""What a machine's emulated links carry at once (its `fabric`, analysis/schedules.py): one
kernel carries every emulated host's link, so that, on 2 cores, four hosts on 2gbit links
moved 0.6 to 0.7 GB/s all together, where their links would take 1 GB/s. Every host sends
FABRIC_BYTES to every other at once over bare TCP on links at the held-out grid's fastest
rate, a few rounds (experiments/runtime/netprobes.py's all_to_all); the median of the bytes/s
all of them moved. `psar compare predict` measures it before its grid
(experiments/comparisons/machine.py), `psar bench` as root (fabric_if_possible)."""

from __future__ import annotations

from statistics import median
from typing import Callable

FABRIC_HOSTS = 4
"""Hosts of the probe: the held-out grid's most common cluster."""
FABRIC_BYTES = 4_000_000
"""Bytes each host sends each other host in a round (about 50 ms of a 2-core machine)."""
FABRIC_ROUNDS = 5


def fastest_rate() -> str:
    """The fastest link rate `psar compare predict` runs (experiments/comparisons/grids.py)."""
    from experiments.comparisons.grids import PREDICT_HELD_OUT
    from experiments.settings.net import parse_rate

    rates = [item.split("=", 1)[1] for nets in PREDICT_HELD_OUT.values() for net in nets
             for item in net.split() if item.startswith("net.rate=")]
    return max(rates, key=parse_rate)


def fabric(rate: str, hosts: int = FABRIC_HOSTS, nbytes: int = FABRIC_BYTES, rounds: int = FABRIC_ROUNDS) -> dict:
    """What `hosts` emulated hosts on links of `rate` move at once, all to all (needs root)."""
    from experiments.runtime.launcher import free_port
    from experiments.runtime.netns import Network

    total = hosts * (hosts - 1) * nbytes
    with Network(tuple(f"f{i}" for i in range(hosts)), rate=rate) as net:
        port = free_port()
        seconds = [max(net.all_to_all(nbytes, port).values()) for _ in range(rounds)]
    return {"hosts": hosts, "rate": rate, "bytes_per_pair": nbytes, "seconds": seconds,
            "bytes_per_s": median(total / s for s in seconds)}


def fabric_if_possible(echo: Callable[[str], None] = print) -> dict | None:
    """fabric(fastest_rate()) where emulated hosts can be made here (`psar bench` as root),
    said in one line; else None, with why."""
    from experiments.runtime.iproute import unavailable

    why = unavailable()
    if why is not None:
        echo(f"fabric: not measured ({why})")
        return None
    carried = fabric(fastest_rate())
    echo(f"fabric: {carried['hosts']} emulated hosts on {carried['rate']} links moved "
         f"{carried['bytes_per_s'] / 1e6:.0f} MB/s all together (median of {len(carried['seconds'])} rounds; "
         f"psar predict --validate --bench reads it)")
    return carried
