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
import threading
import time
from pathlib import Path

from experiments.runtime.zygote import enter_netns

LINKS_FILE = "links.json"
"""The timeline in a run directory of an emulated network (LinkMeter.timeline)."""

INTERVAL_S = 0.01
"""Seconds between two reads of the counters: a tenth of a 100 ms step."""

MAX_READINGS = 6000
"""A longer timeline keeps every other reading (the first and the last always), as often as
it takes, the interval doubling each time: what is dropped is resolution, never bytes (the
counters are cumulative). 60 s at 10 ms; a 10-minute run ends at 160 ms."""

PORT = re.compile(r"p(\d+)|up(\d+)|down(\d+)")
"""The bridge's ports: pI to host number I, upK and downK rack K's uplink (netns.Network)."""

START_S = 5.0
"""Longest wait for the meter's thread to enter the namespace, or to stop."""


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


class LinkMeter:
    """Reads the ports of the bridge namespace `netns` (hosts `names`, host I on port pI)
    every interval_s from start() to stop(); timeline() -> {"interval_s", "t": wall-clock
    seconds of each reading, "links": {link: bytes carried since the first reading}}. The
    links are those of the first reading; a port missing from a later one (its host's
    namespace gone) keeps its last count. `error` says why reading stopped early, if it did."""

    def __init__(self, netns: str, names: tuple[str, ...], interval_s: float = INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.netns, self.names, self.interval_s = netns, names, interval_s
        self._stop = threading.Event()
        self._entered = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._links: tuple[str, ...] = ()
        self._times: list[float] = []
        self._rows: list[tuple[int, ...]] = []
        self._interval = interval_s
        self.error: str | None = None

    def start(self) -> "LinkMeter":
        """Start reading; OSError where the thread cannot enter the namespace (named)."""
        self._thread = threading.Thread(target=self._run, name=f"link meter {self.netns}", daemon=True)
        self._thread.start()
        if not self._entered.wait(START_S) or self.error:
            self.stop()
            raise OSError(f"the link meter could not enter network namespace {self.netns}: "
                          f"{self.error or f'not within {START_S:.0f} s'}")
        return self

    def _run(self) -> None:
        try:
            enter_netns(self.netns)
        except OSError as err:
            self.error = str(err)
            return
        finally:
            self._entered.set()
        dev = Path("/proc/thread-self/net/dev")
        next_at = time.monotonic()
        while True:
            try:
                text = dev.read_text()
                at = time.time()
                self._take(at, series(self.names, read_dev(text)))
            except (OSError, ValueError) as err:
                self.error = self.error or f"reading {dev} in {self.netns}: {err}"
                return
            next_at = max(next_at + self._interval, time.monotonic())
            if self._stop.wait(next_at - time.monotonic()):
                return

    def _take(self, at: float, reading: dict[str, int]) -> None:
        with self._lock:
            if not self._links:
                self._links = tuple(sorted(reading))
            last = self._rows[-1] if self._rows else (0,) * len(self._links)
            self._rows.append(tuple(reading.get(link, prev) for link, prev in zip(self._links, last)))
            self._times.append(at)
            if len(self._rows) > 2 * MAX_READINGS:  # thinned as it goes: a long run's memory stays bounded
                self._times, self._rows = thinned(self._times, self._rows)
                self._interval *= 2

    def stop(self) -> None:
        """Stop reading."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=START_S)
            if self._thread.is_alive():
                self.error = self.error or f"the link meter of {self.netns} did not stop within {START_S:.0f} s"

    def timeline(self) -> dict | None:
        """The readings, each link's bytes counted from the first (at most MAX_READINGS of
        them); None with fewer than two."""
        with self._lock:
            times, rows, interval, links = list(self._times), list(self._rows), self._interval, self._links
        if len(rows) < 2:
            return None
        return as_timeline(times, rows, links, interval, MAX_READINGS)


def thinned(times: list, rows: list) -> tuple[list, list]:
    """Every other reading, the first and the last kept."""
    keep = sorted({0, *range(len(rows) - 1, -1, -2)})
    return [times[i] for i in keep], [rows[i] for i in keep]


def as_timeline(times: list[float], rows: list[tuple[int, ...]], links: tuple[str, ...], interval_s: float,
                most: int = MAX_READINGS) -> dict:
    """Readings (wall times, each a count per link in the order of `links`) as
    LinkMeter.timeline gives them: thinned (the interval doubled) until at most `most` are
    left, each link counted from the first reading."""
    if most < 2:
        raise ValueError(f"most={most}: at least 2 readings")
    while len(rows) > most:
        times, rows = thinned(times, rows)
        interval_s *= 2
    first = rows[0]
    return {"interval_s": interval_s, "t": list(times),
            "links": {link: [row[i] - first[i] for row in rows] for i, link in enumerate(links)}}

