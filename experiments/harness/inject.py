"""Carries out the faults of fault.* in a worker at the start of a step: it dies (SIGKILL),
or its whole process stops for a while (SIGSTOP, continued by a helper), after writing what
and when to RUN_DIR/logs/fault-rank<r>.json for the tables and figures."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from experiments.rundir import files
from experiments.settings.faults import FaultConfig


_helpers: list[subprocess.Popen] = []  # kept, so that none is collected while it runs


def fault_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"fault-rank{rank}.json"


def inject(fault: FaultConfig, rank: int, step: int, restarts: int, run_dir: Path) -> None:
    """Before step's compute on rank: die or stop there if fault says so; else nothing."""
    if fault.kills(rank, step, restarts):
        files.write_json(fault_path(run_dir, rank), {"kind": "kill", "rank": rank, "step": step, "wall": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.pauses(rank, step, restarts) and fault.pause_s > 0:
        start = time.time()
        files.write_json(fault_path(run_dir, rank), {"kind": "pause", "rank": rank, "step": step, "wall": start,
                                                     "pause_s": fault.pause_s})
        # Every thread of this process stops (heartbeats too); the helper, a process of its
        # own, continues it. SIGKILL still ends a stopped process, so nothing outlives a launcher.
        # It counts from the moment the process is stopped, so a SIGCONT never comes first.
        pid = os.getpid()
        script = (f"while ! grep -q '^State:[[:space:]]*T' /proc/{pid}/status 2>/dev/null; do "
                  f"[ -e /proc/{pid} ] || exit 0; sleep 0.01; done; sleep {fault.pause_s}; kill -CONT {pid}")
        _helpers.append(subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True))
        os.kill(os.getpid(), signal.SIGSTOP)
        files.write_json(fault_path(run_dir, rank), {"kind": "pause", "rank": rank, "step": step, "wall": start,
                                                     "pause_s": fault.pause_s, "resumed": time.time()})
