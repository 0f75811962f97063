"""The emulated cluster a run asks for (--net RATE, net.*): its config and tc's rate syntax.
experiments/runtime/netns.py builds it."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


PLACEMENTS = ("colocated", "separate")


@dataclass(frozen=True)
class NetConfig:
    """An emulated cluster for `psar run` and `psar compare` on one machine (--net RATE)."""

    rate: str = ""
    """Every host's link, each way, in tc's units (200mbit, 1gbit); "": no emulated network,
    every process on loopback."""
    latency_ms: float = 0.0
    """One-way delay on every link: netem where the kernel has it, else the engines'
    per-message delay (fault.delay_ms); summary.json records which."""
    placement: str = "colocated"
    """Parameter-server shards on the workers' hosts (shard i on worker i's host, as BytePS
    co-locates them), or "separate": a host of their own each (spare CPU machines)."""

    def __post_init__(self) -> None:
        if self.rate:
            parse_rate(self.rate)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"net.placement={self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if not self.latency_ms >= 0:
            raise ValueError(f"net.latency_ms={self.latency_ms}: must be >= 0")
        if self.latency_ms and not self.rate:
            raise ValueError("net.latency_ms needs an emulated network: give --net RATE too")


def parse_rate(rate: str) -> float:
    """tc's rate syntax ("200mbit", "1gbit", "10mbps": bytes) in bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", rate or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of tc's units "
                         f"({', '.join(_UNITS)}), e.g. 200mbit")
    bits = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be above 0")
    return bits
