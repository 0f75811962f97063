"""What each emulated link carried over a run, as a timeline: the bridge's ports' byte
counters read every INTERVAL_S by a thread of the launching process (`psar run`, `compare`,
`launch`) that has entered the bridge's network namespace (setns moves the calling thread
alone; /proc/thread-self/net/dev then lists that namespace's interfaces, and the processes
the launcher starts, from its main thread, stay where they were). Nothing runs inside the
hosts: one read of a small file per interval, about 0.15 ms of Python.

A port pI of the bridge faces host I: what the port receives is what host I sent, what it
transmits is what host I received. The uplink pair of rack K (with racks): upK transmits what
rack K sends to the core, downK what the core sends to rack K (Network.switch_bytes).
"""

from __future__ import annotations

import re
from pathlib import Path

from experiments.runtime.meter import Meter
from experiments.runtime.zygote import enter_netns

LINKS_FILE = "links.json"
"""The timeline in a run directory of an emulated network (LinkMeter.timeline)."""

INTERVAL_S = 0.01
"""Seconds between two reads of the counters: a tenth of a 100 ms step."""

PORT = re.compile(r"p(\d+)|up(\d+)|down(\d+)")
"""The bridge's ports: pI to host number I, upK and downK rack K's uplink (netns.Network)."""


def read_dev(text: str) -> dict[str, tuple[int, int]]:
    """{port: (bytes received, bytes transmitted)} of the bridge's ports (PORT) from the text
    of /proc/net/dev; ValueError naming a line it cannot read."""
    out = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        name = name.strip()
        if not sep or not PORT.fullmatch(name):
            continue
        fields = rest.split()
        if len(fields) < 16:
            raise ValueError(f"/proc/net/dev: cannot read the line of {name}: {line!r}")
        out[name] = (int(fields[0]), int(fields[8]))
    return out


def series(names: tuple[str, ...], counters: dict[str, tuple[int, int]]) -> dict[str, int]:
    """One reading as {link: bytes so far}: "HOST sent" and "HOST received" for each host
    whose port is there (names[I] on port pI), "up:rK" and "down:rK" for each rack's uplink."""
    out = {}
    for port, (rx, tx) in counters.items():
        host, up, down = PORT.fullmatch(port).groups()
        if host is not None and int(host) < len(names):
            out[f"{names[int(host)]} sent"], out[f"{names[int(host)]} received"] = rx, tx
        elif up is not None:
            out[f"up:r{up}"] = tx
        elif down is not None:
            out[f"down:r{down}"] = tx
    return out


class LinkMeter(Meter):
    """Reads the ports of the bridge namespace `netns` (hosts `names`, host I on port pI)
    every interval_s from start() to stop() (experiments.runtime.meter.Meter); timeline() ->
    {"interval_s", "t": wall-clock seconds of each reading, "links": {link: bytes carried
    since the first reading}}. A port missing from a later reading (its host's namespace
    gone) keeps its last count."""

    def __init__(self, netns: str, names: tuple[str, ...], interval_s: float = INTERVAL_S) -> None:
        super().__init__(interval_s)
        self.netns, self.names = netns, names
        self.what = f"link meter of network namespace {netns}"
        self._dev = Path("/proc/thread-self/net/dev")

    def enter(self) -> None:
        enter_netns(self.netns)

    def read(self) -> dict[str, int]:
        try:
            return series(self.names, read_dev(self._dev.read_text()))
        except OSError as err:
            raise OSError(f"reading {self._dev} in {self.netns}: {err}") from None
        except ValueError as err:  # UnicodeDecodeError included
            raise ValueError(f"reading {self._dev} in {self.netns}: {err}") from None

    def timeline(self) -> dict | None:
        """The readings, each link's bytes counted from the first (at most
        meter.MAX_READINGS of them); None with fewer than two."""
        return self.counts("links")

