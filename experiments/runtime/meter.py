"""Cumulative counters read every few ms by a thread of the launching process (`psar run`,
`compare`, `launch`) from the start of a run's processes to their end, kept as a timeline:
what each emulated link carried (linkmeter.LinkMeter) and what the host's cores did
(cpumeter.CpuMeter). Nothing runs in the processes measured.

The counters only grow, so a long run keeps every other reading (the first and the last
always), as often as it takes: what it loses is resolution, never a count.
"""

from __future__ import annotations

import sys
import threading
import time

MAX_READINGS = 6000
"""A longer timeline keeps every other reading (the first and the last always), as often as
it takes, the interval doubling each time: what is dropped is resolution, never a count (the
counters are cumulative). The link meter's 10 ms reach it at 60 s (a 10-minute run ends read
every 160 ms), the CPU meter's 50 ms at 5 minutes."""

START_S = 5.0
"""Longest wait for a meter's thread to be ready to read (LinkMeter: to enter its
namespace), or to stop."""


class Meter:
    """Reads counters (read(): {name: count so far}) every interval_s from start() to stop(),
    on a thread of its own that first runs enter(). A name first seen in a later reading
    counts from there (late_from_zero: from 0 in the readings before it); one missing from a
    later reading keeps its last count. `error` says why reading stopped early, if it did."""

    what = "meter"
    """Its name in errors."""

    late_from_zero = False
    """Whether a name first seen in a later reading counted 0 before it, its whole first count
    then carried in the interval it came (a process started after the meter: its CPU time
    from its start), or (False) its first count (a counter whose past is not the run's)."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0")
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._entered = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._names: tuple[str, ...] = ()
        self._times: list[float] = []
        self._rows: list[tuple[int, ...]] = []
        self._interval = interval_s
        self.error: str | None = None

    def enter(self) -> None:
        """Run on the meter's thread before its first reading; OSError where it cannot read."""

    def read(self) -> dict[str, int]:
        """{name: its count so far}; OSError or ValueError stops the readings."""
        raise NotImplementedError

    def start(self) -> "Meter":
        """Start reading; OSError (naming the meter) where its thread cannot enter or read."""
        self._thread = threading.Thread(target=self._run, name=self.what, daemon=True)
        self._thread.start()
        if not self._entered.wait(START_S) or self.error:
            self.stop()
            raise OSError(f"the {self.what} could not start: {self.error or f'not ready within {START_S:.0f} s'}")
        return self

    def _run(self) -> None:
        try:
            self.enter()
            read = self._reading()
        except Exception as err:
            self.error, read = _named(err), False
        finally:
            self._entered.set()
        next_at = time.monotonic()
        while read:
            next_at = max(next_at + self._interval, time.monotonic())
            stopping = self._stop.wait(next_at - time.monotonic())
            read = self._reading() and not stopping  # when told to stop, a last reading: the timeline reaches the end

    def _reading(self) -> bool:
        """One more reading; False (the error kept) where it failed."""
        try:
            reading = self.read()
        except Exception as err:  # an OSError or ValueError of read(), or anything unforeseen: named, never silent
            self.error = self.error or _named(err)
            return False
        self._take(time.time(), reading)
        return True

    def _take(self, at: float, reading: dict[str, int]) -> None:
        with self._lock:
            new = sorted(set(reading) - set(self._names))
            if new:
                before = tuple(0 if self.late_from_zero else reading[name] for name in new)
                self._names += tuple(new)
                self._rows = [row + before for row in self._rows]
            last = self._rows[-1] if self._rows else (0,) * len(self._names)
            self._rows.append(tuple(reading.get(name, prev) for name, prev in zip(self._names, last)))
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
                self.error = self.error or f"the {self.what} did not stop within {START_S:.0f} s"

    def timeline(self) -> dict | None:
        """The readings as the run directory keeps them (each meter's own file)."""
        raise NotImplementedError

    def finish(self, file: str, quiet: bool = False) -> dict | None:
        """Stop reading; the timeline, said on stderr (unless quiet) where the readings stopped
        early, naming the file it goes to."""
        self.stop()
        if self.error and not quiet:
            print(f"psar: {file} stops early: {self.error}", file=sys.stderr)
        return self.timeline()

    def counts(self, key: str) -> dict | None:
        """The readings as {"interval_s", "t": wall-clock seconds of each, key: {name: its
        count since the first reading}}, at most MAX_READINGS of them (as_timeline); None
        with fewer than two."""
        with self._lock:
            times, rows, interval, names = list(self._times), list(self._rows), self._interval, self._names
        if len(rows) < 2:
            return None
        return as_timeline(times, rows, names, interval, MAX_READINGS, key)


def _named(err: Exception) -> str:
    """What went wrong, for `error`: a read's OSError or ValueError as it says it, anything
    else with its type."""
    return str(err) if isinstance(err, (OSError, ValueError)) else f"{type(err).__name__}: {err}"


def thinned(times: list, rows: list) -> tuple[list, list]:
    """Every other reading, the first and the last kept."""
    keep = sorted({0, *range(len(rows) - 1, -1, -2)})
    return [times[i] for i in keep], [rows[i] for i in keep]


def as_timeline(times: list[float], rows: list[tuple[int, ...]], names: tuple[str, ...], interval_s: float,
                most: int = MAX_READINGS, key: str = "links") -> dict:
    """Readings (wall times, each a count per name in the order of `names`) as Meter.counts
    gives them: thinned (the interval doubled) until at most `most` are left, each name
    counted from the first reading, under `key`."""
    if most < 2:
        raise ValueError(f"most={most}: at least 2 readings")
    while len(rows) > most:
        times, rows = thinned(times, rows)
        interval_s *= 2
    first = rows[0]
    return {"interval_s": interval_s, "t": list(times),
            key: {name: [row[i] - first[i] for row in rows] for i, name in enumerate(names)}}
