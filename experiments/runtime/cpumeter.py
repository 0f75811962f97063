"""What the host's cores did over a run, as a timeline: the machine's CPU time counters
(/proc/stat, in clock ticks) of the cores the launcher may run on (its affinity, as its
processes' threads are counted: ps/cores.py), added up, read every INTERVAL_S by a thread of
the launching process (experiments.runtime.meter). Other tenants' work on those cores counts
too: the shares say what the cores did, not what the run alone did. On one machine that runs every
worker, every shard and the kernel that emulates their links, a comparison measures its cores
as much as its links once they are all busy: analysis/hostcpu.py says how busy they were
during the run's steps (`psar table`'s "host cpu", `psar links`, `psar predict --validate`).
"""

from __future__ import annotations

import os
from pathlib import Path

from experiments.runtime.meter import Meter

CPU_FILE = "cpu.json"
"""The timeline in a run directory (CpuMeter.timeline)."""

INTERVAL_S = 0.05
"""Seconds between two reads: five of the counters' ticks (1/100 s) a core."""

STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
"""/proc/stat's first columns in order (guest time is counted in user's already)."""


def read_stat(text: str, cpus: frozenset[int] | None = None) -> tuple[dict[str, int], int]:
    """({state: ticks}, the number of cores counted) from the text of /proc/stat: the cores
    `cpus` together (their cpuN lines; those not listed there are left out), or every core
    (its first line) where cpus is None; ValueError naming what it cannot read."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("cpu "):
        raise ValueError(f"/proc/stat: expected the line of every core ('cpu') first, got {lines[:1]!r}")
    rows = {}  # None: every core; N: core N
    for line in lines:
        name = line.split(maxsplit=1)[0] if line.strip() else ""
        if name == "cpu" or (name.startswith("cpu") and name[3:].isdigit()):
            rows[None if name == "cpu" else int(name[3:])] = line
    cores = sorted(k for k in rows if k is not None)
    if not cores:
        raise ValueError("/proc/stat: no line of a core (cpuN)")
    chosen = [None] if cpus is None else [k for k in cores if k in cpus]
    if not chosen:
        raise ValueError(f"/proc/stat: none of the cores this process may run on ({sorted(cpus)}) is listed")
    ticks = dict.fromkeys(STATES, 0)
    for key in chosen:
        fields = rows[key].split()
        if len(fields) < 1 + len(STATES):
            raise ValueError(f"/proc/stat: expected {len(STATES)} counters, got {rows[key]!r}")
        try:
            for state, value in zip(STATES, fields[1:1 + len(STATES)]):
                ticks[state] += int(value)
        except ValueError:
            raise ValueError(f"/proc/stat: counters that are not integers: {rows[key]!r}") from None
    return ticks, len(cores) if cpus is None else len(chosen)


def allowed_cpus() -> frozenset[int] | None:
    """The cores this process may run on (its affinity: a container's or taskset's), None where
    the platform does not say: the launcher's processes run on those, so the meter counts
    those alone."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class CpuMeter(Meter):
    """Reads the host's CPU time counters every interval_s from start() to stop()
    (experiments.runtime.meter.Meter); timeline() -> {"interval_s", "t": wall-clock seconds
    of each reading, "cores", "ticks": {state: ticks since the first reading, every core
    together}}."""

    what = "CPU meter (/proc/stat)"

    def __init__(self, interval_s: float = INTERVAL_S, path: Path = Path("/proc/stat"),
                 cpus: frozenset[int] | None = None) -> None:
        super().__init__(interval_s)
        self.path, self.cpus = path, cpus
        self.cores = 0

    def read(self) -> dict[str, int]:
        ticks, self.cores = read_stat(self.path.read_text(), self.cpus)
        return ticks

    def timeline(self) -> dict | None:
        """The readings, each state's ticks counted from the first (at most
        meter.MAX_READINGS of them), and the host's cores; None with fewer than two."""
        out = self.counts("ticks")
        return None if out is None else {**out, "cores": self.cores}
