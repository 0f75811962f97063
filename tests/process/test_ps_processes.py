"""`psar server` and `psar worker` as separate processes over TCP, as on several hosts, and
what happens when one of them goes away."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from experiments.rundir import checkpoint
from ps.config import PSConfig
from ps.cores import host_cores, io_threads
from experiments.engines import get_engine
import forked
from conftest import started, wait_for_steps
from experiments.runtime.launcher import free_port

pytestmark = [pytest.mark.multiprocess]

# Heartbeats and liveness fast; the join window (ps.timeout_s) long enough for every process
# to start under load (round 3 of a loaded `make stress` saw a worker join after more than 6 s).
FAST_LIVENESS = ["--set", "ps.timeout_s=30", "--set", "ps.heartbeat_s=0.2", "--set", "ps.worker_timeout_s=3"]


def psar(*args, env=None) -> forked.Forked:
    return started(forked.psar(*args, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))))


def finish(proc, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"process did not end within {timeout} s:\n{out}")
    return proc.returncode, out


def start_cluster(tmp_path, engine="ps-sync", steps=20, shards=2, extra=(), env_rank=False):
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(shards)]
    common = ["--engine", engine, *extra]
    servers = [psar("server", "--bind", a, "--experiment", "quickstart", "--workers", 2,
                    "--shard", f"{i}/{shards}", "--out", tmp_path / "run", *common)
               for i, a in enumerate(addresses)]
    workers = []
    for rank in range(2):
        who = (["--rank", rank, "--world", 2], None) if not env_rank else ([], {"RANK": str(rank), "WORLD_SIZE": "2"})
        workers.append(psar("worker", "quickstart", "--servers", ",".join(addresses), *who[0],
                            "--steps", steps, "--out", tmp_path / "run", *common, env=who[1]))
    return addresses, servers, workers


@pytest.mark.timeout(300)
def test_servers_and_workers_over_tcp(tmp_path):
    addresses, servers, workers = start_cluster(tmp_path, env_rank=True)
    for proc in workers + servers:
        code, out = finish(proc, 120)
        assert code == 0, out
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["engine"] == "ps-sync" and summary["workers"] == 2 and summary["servers"] == 2
    shards = [json.loads((tmp_path / f"run/metrics/server{i}.json").read_text()) for i in range(2)]
    assert {s["result"] for s in shards} == {"finished"}
    # psar server alone on its host: every core of it for the updates, a connection a worker
    assert {(s["threads"], s["io_threads"]) for s in shards} == {(host_cores(), io_threads(host_cores(), 2))}
    assert summary["eval"]["accuracy"] > 0.5


@pytest.mark.timeout(300)
def test_worker_whose_server_is_gone_names_it(tmp_path):
    addresses, servers, workers = start_cluster(tmp_path, steps=100000, extra=FAST_LIVENESS)
    wait_for_steps(tmp_path / "run", 1, 20)
    servers[1].send_signal(signal.SIGKILL)
    for proc in workers:
        code, out = finish(proc, 60)
        assert code != 0
        assert addresses[1] in out, out
        assert "Traceback" not in out
    for proc in servers:
        finish(proc, 60)


@pytest.mark.timeout(300)
# None: the default, which drops a lost worker under ps-async and ps-ssp and aborts ps-sync
# (tests/unit/test_ps_layout.py). ps-async and ps-ssp drop as ps-sync with "drop" does: make bench.
@pytest.mark.parametrize("engine,policy", [("ps-sync", "drop"), ("ps-sync", None),
                                           pytest.param("ps-async", None, marks=pytest.mark.long),
                                           pytest.param("ps-ssp", None, marks=pytest.mark.long)])
def test_lost_worker_is_dropped_or_aborts(tmp_path, engine, policy):
    extra = FAST_LIVENESS + ["--set", "checkpoint.every=50"]
    extra += ["--set", f"ps.on_worker_loss={policy}"] if policy else []
    policy = policy or PSConfig().loss_policy(get_engine(engine).consistency)
    addresses, servers, workers = start_cluster(tmp_path, engine=engine, steps=500, shards=1, extra=extra)
    wait_for_steps(tmp_path / "run", 1, 20)
    workers[1].send_signal(signal.SIGKILL)
    code0, out0 = finish(workers[0], 90)
    code_s, out_s = finish(servers[0], 90)
    finish(workers[1], 10)
    assert "worker 1" in out_s
    if policy == "drop":
        assert code0 == 0, out0
        summary = json.loads((tmp_path / "run/summary.json").read_text())
        assert summary["steps"] == 500
        assert summary["server_stats"][0]["lost_workers"].keys() == {"1"}
    else:
        assert code0 != 0 and "worker 1" in out0, out0
        assert code_s != 0
        # Stopped cleanly: the shard's state at the abort is on disk, ready for --resume.
        state = checkpoint.load(checkpoint.server_path(tmp_path / "run", 0))
        assert state["version"] >= 20


@pytest.mark.timeout(300)
def test_a_worker_with_other_settings_is_refused(tmp_path):
    """One worker given another --seed (a shard checks at join), then two all-reduce workers
    given other --steps (rank 0 checks at rendezvous): each is refused, naming the setting."""
    address = f"tcp://127.0.0.1:{free_port()}"
    common = ["--engine", "ps-sync", *FAST_LIVENESS]
    server = psar("server", "--bind", address, "--experiment", "quickstart", "--workers", 2,
                  "--out", tmp_path / "ps", *common)
    workers = [psar("worker", "quickstart", "--servers", address, "--rank", rank, "--world", 2,
                    "--steps", 20, "--out", tmp_path / "ps", *common, *seed)
               for rank, seed in ((0, []), (1, ["--seed", 3]))]
    code, out = finish(workers[1], 120)
    assert code != 0 and "seed: worker 1 has 3, shard 0 has 0" in out, out
    # Worker 1 never joins, so the shard and worker 0 would wait out their join window: stop them.
    # (A window short enough to wait out would also bound worker 1's wait for a shard still starting.)
    for proc in (workers[0], server):
        proc.kill()
        finish(proc, 30)
    port = str(free_port())
    workers = [psar("worker", "quickstart", "--engine", "allreduce", "--rank", rank, "--world", 2,
                    "--steps", steps, "--out", tmp_path / "ar", env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
               for rank, steps in ((0, 20), (1, 25))]
    for proc in workers:
        code, out = finish(proc, 120)
        assert code != 0 and "rank 1 has other settings than rank 0: steps: rank 1 has 25, rank 0 has 20" in out, out
