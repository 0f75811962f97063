"""What each emulated link carried over a run, as a timeline: the bridge's ports' byte
counters read every INTERVAL_S by a thread of the launching process that has entered the
bridge's network namespace (setns applies to the calling thread alone; /proc/thread-self/net/dev
then lists that namespace's interfaces). Nothing runs inside the hosts, and no process is
started: one read of a small file per interval.

A port pI of the bridge faces host I: what the port receives is what host I sent, what it
transmits is what host I received. The uplink pair of rack K (with racks): upK transmits what
rack K sends to the core, downK what the core sends to rack K (Network.switch_bytes).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from pathlib import Path

LINKS_FILE = "links.json"
"""The timeline in a run directory of an emulated network (LinkMeter.timeline)."""

INTERVAL_S = 0.01
"""Seconds between two reads of the counters: a tenth of a 100 ms step."""

MAX_READINGS = 6000
"""A longer timeline keeps every other reading, as often as it takes (the counters are
cumulative: what is dropped is resolution, never bytes)."""

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
_PORT = re.compile(r"p\d+|up\d+|down\d+")


def read_dev(text: str) -> dict[str, tuple[int, int]]:
    """{interface: (bytes received, bytes transmitted)} of the bridge's ports (pI, upK, downK)
    from the text of /proc/net/dev; ValueError naming a line it cannot read."""
    out = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        name = name.strip()
        if not sep or not _PORT.fullmatch(name):
            continue
        fields = rest.split()
        if len(fields) < 16:
            raise ValueError(f"/proc/net/dev: cannot read the line of {name}: {line!r}")
        out[name] = (int(fields[0]), int(fields[8]))
    return out


def series(names: tuple[str, ...], counters: dict[str, tuple[int, int]]) -> dict[str, int]:
    """One reading as {link: bytes so far}: "HOST sent" and "HOST received" for each host
    (names[I] on port pI), "up:rK" and "down:rK" for each rack's uplink."""
    out = {}
    for i, name in enumerate(names):
        rx, tx = counters.get(f"p{i}", (0, 0))
        out[f"{name} sent"], out[f"{name} received"] = rx, tx
    for dev, (_, tx) in counters.items():
        m = re.fullmatch(r"(up|down)(\d+)", dev)
        if m:
            out[f"{m.group(1)}:r{m.group(2)}"] = tx
    return out


class LinkMeter:
    """Reads the ports of the bridge namespace `netns` (hosts `names`, host I on port pI)
    every interval_s from start() to stop(); timeline() -> {"interval_s", "t": wall-clock
    seconds of each reading, "links": {link: bytes carried since the first reading}}."""

    def __init__(self, netns: str, names: tuple[str, ...], interval_s: float = INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.netns, self.names, self.interval_s = netns, names, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._times: list[float] = []
        self._rows: list[dict[str, int]] = []
        self.error: str | None = None

    def start(self) -> "LinkMeter":
        path = NETNS_DIR / self.netns
        fd = os.open(path, os.O_RDONLY)  # here, so that a missing namespace fails the caller
        self._thread = threading.Thread(target=self._run, args=(fd,), name=f"link meter {self.netns}", daemon=True)
        self._thread.start()
        return self

    def _run(self, fd: int) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.netns}: {os.strerror(ctypes.get_errno())}")
        except (OSError, AttributeError) as err:
            self.error = str(err)
            return
        finally:
            os.close(fd)
        dev = Path("/proc/thread-self/net/dev")
        next_at = time.monotonic()
        while True:
            try:
                counters = read_dev(dev.read_text())
            except (OSError, ValueError) as err:  # the namespace went first: the run is over
                self.error = self.error or str(err)
                return
            self._times.append(time.time())
            self._rows.append(series(self.names, counters))
            next_at += self.interval_s
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return

    def stop(self) -> None:
        """Stop reading."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            if self._thread.is_alive():
                self.error = self.error or f"the link meter of {self.netns} did not stop within 5 s"

    def timeline(self) -> dict | None:
        """The readings, each link's bytes counted from the first (at most MAX_READINGS of
        them); None with fewer than two."""
        if len(self._rows) < 2:
            return None
        return as_timeline(self._times, self._rows, self.interval_s)


def as_timeline(times: list[float], rows: list[dict[str, int]], interval_s: float,
                most: int = MAX_READINGS) -> dict:
    """Readings (wall times, {link: bytes so far}) as LinkMeter.timeline gives them: each
    link counted from the first reading, every other reading dropped (the interval doubled)
    until at most `most` are left; the last reading is always kept."""
    if most < 2:
        raise ValueError(f"most={most}: at least 2 readings")
    while len(rows) > most:
        keep = list(range(len(rows) - 1, -1, -2))[::-1]  # every other one, counted back from the last
        times, rows, interval_s = [times[i] for i in keep], [rows[i] for i in keep], 2 * interval_s
    first = rows[0]
    links = {name: [row.get(name, 0) - first[name] for row in rows] for name in first}
    return {"interval_s": interval_s, "t": list(times), "links": links}
