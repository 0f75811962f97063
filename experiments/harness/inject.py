"""Carries out the faults of fault.* in a worker at the start of a step: it dies (SIGKILL),
or its whole process stops for a while (SIGSTOP, continued by a helper), after writing what
and when to RUN_DIR/logs/fault-rank<r>.json for the tables and figures; or, a straggler, it
sleeps before each step's compute."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from experiments.rundir import files
from experiments.settings.faults import FaultConfig


_helpers: list[subprocess.Popen] = []  # kept, so that none is collected while it runs


def fault_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"fault-rank{rank}.json"


class Faults:
    """fault.* as one worker process meets them, before each step's compute: it dies, stops
    once, or stalls as a straggler. Only a job's first attempt is struck by a kill or a stop
    (a restarted process runs through), at the first step it runs from the one named on (a
    worker going on at the shards' step may never run that one)."""

    def __init__(self, fault: FaultConfig, rank: int, restarts: int, run_dir: Path) -> None:
        self.fault, self.rank, self.run_dir = fault, rank, Path(run_dir)
        self.first = restarts == 0
        self.paused = False
        self.straggler = Straggler(fault, rank)
        self.steps_run = 0

    def before_step(self, step: int, last_compute_s: float) -> None:
        if self.first and self.fault.kills(self.rank, step):
            self._record({"kind": "kill", "step": step, "wall": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        if self.first and not self.paused and self.fault.pauses(self.rank, step):
            self.paused = True
            self._pause(step)
        self.straggler.stall(self.steps_run, last_compute_s)
        self.steps_run += 1

    def _record(self, event: dict) -> None:
        files.write_json(fault_path(self.run_dir, self.rank), {"rank": self.rank, **event})

    def _pause(self, step: int) -> None:
        start, pause_s = time.time(), self.fault.pause_s
        self._record({"kind": "pause", "step": step, "wall": start, "pause_s": pause_s})
        # Every thread of this process stops (heartbeats too); the helper, a process of its
        # own, continues it. SIGKILL still ends a stopped process, so nothing outlives a launcher.
        # It counts from the moment the process is stopped, so a SIGCONT never comes first.
        pid = os.getpid()
        script = (f"while ! grep -q '^State:[[:space:]]*T' /proc/{pid}/status 2>/dev/null; do "
                  f"[ -e /proc/{pid} ] || exit 0; sleep 0.01; done; sleep {pause_s}; kill -CONT {pid}")
        _helpers.append(subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True))
        os.kill(pid, signal.SIGSTOP)
        self._record({"kind": "pause", "step": step, "wall": start, "pause_s": pause_s, "resumed": time.time()})


REFERENCE_STEPS = 3
"""A straggler's steps 1..REFERENCE_STEPS run at full speed; their median compute is what it
then takes slow_factor times of (step 0 pays for allocation)."""


class Straggler:
    """fault.slow_rank's stall before each step's compute, so that its compute takes
    slow_factor times what it took in its reference steps, when every worker computed alike.

    Taking slow_factor times its own last compute instead would slow it by less wherever
    workers share cores (4 workers on 2 here): while it sleeps the others have its cores, and
    it then computes alone, faster than before. Measured with cnn on 4 workers, a 3x straggler
    made so cost the ring 0.65x of its steps per second, where a worker 3x slower than the
    others costs a synchronous engine about a third.
    """

    def __init__(self, fault: FaultConfig, rank: int) -> None:
        self.on = rank == fault.slow_rank and fault.slow_factor > 1.0
        self.factor = fault.slow_factor
        self.reference: list[float] = []

    def stall(self, step_index: int, last_compute_s: float) -> None:
        """Before the compute of the step_index-th step this process runs (0: its first),
        given the last one's compute time."""
        if not self.on or step_index <= 1:  # nothing measured yet, or step 0's (allocation)
            return
        if len(self.reference) < REFERENCE_STEPS:
            self.reference.append(last_compute_s)
            if len(self.reference) < REFERENCE_STEPS:
                return
        time.sleep(max(0.0, self.factor * statistics.median(self.reference) - last_compute_s))
