"""A real process killed with SIGKILL mid-run: the survivors end, within the configured
timeout, with a message that names the lost rank; nothing hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for_steps
from experiments.runtime.launcher import free_port

pytestmark = [pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]


def start_workers(tmp_path: Path, engine: str, world: int = 2) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "experiments.cli", "worker", "cnn", "--engine", engine,
             "--steps", "100000", "--out", str(tmp_path / "run"), "--set", "timeout_s=20"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine,victim", [("allreduce", 1), ("allreduce", 0), ("ddp", 1)])
def test_survivor_names_the_killed_rank(tmp_path, engine, victim):
    procs = start_workers(tmp_path, engine)
    try:
        wait_for_steps(tmp_path / "run", 0, 5)
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = procs[1 - victim]
        out, _ = survivor.communicate(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert survivor.returncode != 0
    assert f"rank {victim} is gone" in out, out
    assert "Traceback" not in out
    assert elapsed < 30, f"the survivor took {elapsed:.1f} s to end"
    print(f"{engine}: rank {1 - victim} ended {elapsed:.1f} s after rank {victim} was killed")
