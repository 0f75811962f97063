"""A real process killed with SIGKILL mid-run: the survivors end, within the configured
timeout, with a message that names the lost rank; nothing hangs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import forked
from conftest import wait_for_steps
from experiments.runtime.launcher import free_port

pytestmark = [pytest.mark.multiprocess]


def start_workers(tmp_path: Path, engine: str, world: int = 2) -> list[forked.Forked]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(forked.psar("worker", "cnn", "--engine", engine, "--steps", "100000",
                                 "--out", tmp_path / "run", "--set", "timeout_s=20", env=env))
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
