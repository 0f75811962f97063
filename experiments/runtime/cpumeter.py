"""What the host's cores did over a run, as a timeline: the machine's CPU time counters
(/proc/stat, in clock ticks) of the cores the launcher may run on (its affinity, as its
processes' threads are counted: ps/cores.py), added up, read every INTERVAL_S by a thread of
the launching process (experiments.runtime.meter). Other tenants' work on those cores counts
too: the shares say what the cores did, not what the run alone did. On one machine that runs every
worker, every shard and the kernel that emulates their links, a comparison measures its cores
as much as its links once they are all busy: analysis/hostcpu.py says how busy they were
during the run's steps (`psar table`'s "host cpu", `psar links`, `psar predict --validate`).

The meter also reads the CPU time of each process the launcher started (watch: its ranks and
its shards, /proc/PID/stat's user and system ticks, every thread of the process together),
so that a run says which of them held the cores. A process's system time holds the kernel's
work on its behalf (its sends through TCP, the qdiscs and the veths, and soft interrupts that
ran in its context); the rest is the kernel's work outside them, the launcher's, and anything
else on the host. A process started again under the same name (a restarted rank) goes on from
its predecessor's count; one that has ended keeps its last reading's count (at most an
interval's worth is lost).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import NamedTuple

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


def read_process(text: str) -> tuple[int, int]:
    """(user + system ticks, its start time in ticks after boot) from the text of
    /proc/PID/stat; ValueError naming what it cannot read. The command's name, in
    parentheses, may hold spaces and parentheses: the fields are those after its last ')'."""
    fields = text.rpartition(")")[2].split()
    try:  # the fields from the state (3rd) on: utime is the 14th, stime the 15th, starttime the 22nd
        return int(fields[11]) + int(fields[12]), int(fields[19])
    except (IndexError, ValueError):
        raise ValueError(f"/proc/PID/stat: expected utime, stime and starttime, got {text[:120]!r}") from None


def process_ticks(pid: int, proc: Path = Path("/proc")) -> tuple[int, int]:
    """(user + system ticks, start time) of process pid (read_process); OSError where it is
    gone, ValueError where its stat cannot be read."""
    return read_process((proc / str(pid) / "stat").read_text())


def cores_in_windows(pids: list[int], windows: list[tuple[float, float]], clock=time.time,
                     sleep=time.sleep) -> list[float | None]:
    """For each (start, end) window of wall-clock time, in order, the most cores any one of
    pids held through it (its ticks between a read at the start and one at the end, over the
    seconds between the two reads); None where a window was already past when its turn came,
    or no process could be read at both ends. A bench's phases at fixed times (ps.benchmark's
    loads) read this way say what the processes serving them used."""
    hz = os.sysconf("SC_CLK_TCK")
    out = []
    for start, end in windows:
        if clock() > start + 0.1 * (end - start):
            out.append(None)
            continue
        sleep(max(0.0, start - clock()))
        before, t0 = _ticks(pids), clock()
        sleep(max(0.0, end - clock()))
        after, t1 = _ticks(pids), clock()
        held = [(after[p] - before[p]) / hz / (t1 - t0) for p in before if p in after and t1 > t0]
        out.append(max(held) if held else None)
    return out


def _ticks(pids: list[int]) -> dict[int, int]:
    found = {}
    for pid in pids:
        try:
            found[pid] = process_ticks(pid)[0]
        except (OSError, ValueError):
            pass
    return found


def allowed_cpus() -> frozenset[int] | None:
    """The cores this process may run on (its affinity: a container's or taskset's), None where
    the platform does not say: the launcher's processes run on those, so the meter counts
    those alone."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


PROCESS = "process "
"""A watched process's count among the meter's names: "process rank 0", "process server 1"."""


class _Watched(NamedTuple):
    pid: int
    start: int  # its start time (/proc/PID/stat): a pid taken again later is another process
    before: int  # the ticks of those before it under its name


class CpuMeter(Meter):
    """Reads the host's CPU time counters every interval_s from start() to stop()
    (experiments.runtime.meter.Meter), and those of each process watch() names; timeline() ->
    {"interval_s", "t": wall-clock seconds of each reading, "cores", "ticks": {state: ticks
    since the first reading, every core together}, "processes": {name: its user and system
    ticks since the first reading}}."""

    what = "CPU meter (/proc/stat)"
    late_from_zero = True  # a process watched from its start: all its time is the run's

    def __init__(self, interval_s: float = INTERVAL_S, path: Path = Path("/proc/stat"),
                 cpus: frozenset[int] | None = None, proc: Path = Path("/proc")) -> None:
        super().__init__(interval_s)
        self.path, self.cpus, self.proc = path, cpus, proc
        self.cores = 0
        self._watching = threading.Lock()
        self._watched: dict[str, _Watched] = {}
        self._last: dict[str, int] = {}  # name -> its count at the last reading

    def watch(self, name: str, pid: int) -> None:
        """Count the CPU time of process pid under name from now on (after any process that
        had the name: a restarted rank). A process already gone is not counted."""
        try:
            ticks, start = process_ticks(pid, self.proc)
        except (OSError, ValueError):
            return
        with self._watching:
            self._watched[name] = _Watched(pid, start, self._last.get(name, 0))
            self._last[name] = self._last.get(name, 0) + ticks

    def read(self) -> dict[str, int]:
        ticks, self.cores = read_stat(self.path.read_text(), self.cpus)
        with self._watching:
            for name, w in self._watched.items():
                try:
                    now, start = process_ticks(w.pid, self.proc)
                except (OSError, ValueError):  # ended (and reaped): its last count stays
                    continue
                if start == w.start:
                    self._last[name] = w.before + now
            ticks.update({PROCESS + name: count for name, count in self._last.items()})
        return ticks

    def timeline(self) -> dict | None:
        """The readings, each count from the first (at most meter.MAX_READINGS of them), and
        the host's cores; None with fewer than two."""
        out = self.counts("ticks")
        if out is None:
            return None
        counts = out.pop("ticks")
        return {**out, "cores": self.cores, "ticks": {s: c for s, c in counts.items() if not s.startswith(PROCESS)},
                "processes": {s[len(PROCESS):]: c for s, c in counts.items() if s.startswith(PROCESS)}}
