"""What the host's cores did over a run, as a timeline: the machine's CPU time counters
(/proc/stat's first line, in clock ticks, every core together) read every INTERVAL_S by a
thread of the launching process (experiments.runtime.meter). On one machine that runs every
worker, every shard and the kernel that emulates their links, a comparison measures its cores
as much as its links once they are all busy: analysis/hostcpu.py says how busy they were
during the run's steps (`psar table`'s "host cpu", `psar links`, `psar predict --validate`).
"""

from __future__ import annotations

from pathlib import Path

from experiments.runtime.meter import Meter

CPU_FILE = "cpu.json"
"""The timeline in a run directory (CpuMeter.timeline)."""

INTERVAL_S = 0.05
"""Seconds between two reads: five of the counters' ticks (1/100 s) a core."""

STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
"""/proc/stat's first columns in order (guest time is counted in user's already)."""


def read_stat(text: str) -> tuple[dict[str, int], int]:
    """({state: ticks of every core together}, the number of cores) from the text of
    /proc/stat; ValueError naming what it cannot read."""
    lines = text.splitlines()
    first = lines[0].split() if lines else []
    if len(first) < 1 + len(STATES) or first[0] != "cpu":
        raise ValueError(f"/proc/stat: expected 'cpu' and {len(STATES)} counters first, got {lines[:1]!r}")
    try:
        ticks = dict(zip(STATES, map(int, first[1:1 + len(STATES)])))
    except ValueError:
        raise ValueError(f"/proc/stat: counters that are not integers: {lines[0]!r}") from None
    cores = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    if cores < 1:
        raise ValueError("/proc/stat: no line of a core (cpuN)")
    return ticks, cores


class CpuMeter(Meter):
    """Reads the host's CPU time counters every interval_s from start() to stop()
    (experiments.runtime.meter.Meter); timeline() -> {"interval_s", "t": wall-clock seconds
    of each reading, "cores", "ticks": {state: ticks since the first reading, every core
    together}}."""

    what = "CPU meter (/proc/stat)"

    def __init__(self, interval_s: float = INTERVAL_S, path: Path = Path("/proc/stat")) -> None:
        super().__init__(interval_s)
        self.path = path
        self.cores = 0

    def read(self) -> dict[str, int]:
        ticks, self.cores = read_stat(self.path.read_text())
        return ticks

    def timeline(self) -> dict | None:
        """The readings, each state's ticks counted from the first (at most
        meter.MAX_READINGS of them), and the host's cores; None with fewer than two."""
        out = self.counts("ticks")
        return None if out is None else {**out, "cores": self.cores}
