"""A server shard killed with SIGKILL and restarted with --resume: the workers wait for it,
join again and go on; the summary says how many updates were lost (at most one checkpoint
interval)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from conftest import wait_for_steps
from test_ps_processes import finish, psar, start_cluster

pytestmark = [pytest.mark.multiprocess]

EVERY = 10


@pytest.mark.timeout(300)
def test_killed_shard_comes_back_from_its_checkpoint(tmp_path, engine="ps-sync"):
    # (ps-async recovers the same way; tried by hand)
    extra = ["--set", "ps.timeout_s=20", "--set", "ps.heartbeat_s=0.2", "--set", "ps.worker_timeout_s=20",
             "--set", "ps.reconnect_s=60", "--set", f"checkpoint.every={EVERY}"]
    addresses, servers, workers = start_cluster(tmp_path, engine=engine, steps=300, shards=2, extra=extra)
    wait_for_steps(tmp_path / "run", 1, 3 * EVERY + 5)
    servers[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    finish(servers[1], 10)
    time.sleep(1.0)  # down for a moment, then back from its checkpoint on the same address
    restarted = psar("server", "--bind", addresses[1], "--experiment", "quickstart", "--workers", 2,
                     "--shard", "1/2", "--out", tmp_path / "run", "--resume", "--engine", engine, *extra)
    outputs = [finish(proc, 240) for proc in workers]
    for code, out in outputs:
        assert code == 0, out
    assert finish(restarted, 60)[0] == 0
    finish(servers[0], 60)
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["steps"] == 300
    assert summary["updates_lost"] <= EVERY  # at most the steps since the shard's last checkpoint
    assert any("rejoined" in out for _, out in outputs), outputs[0][1][-2000:]
    print(f"{engine}: {summary['updates_lost']} updates lost; run ended "
          f"{time.monotonic() - killed_at:.1f} s after the kill")
