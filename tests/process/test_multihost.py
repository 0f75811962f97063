"""psar across real hosts: three network namespaces on a private subnet stand in for three
machines, so the parameter server and the all-reduce talk over real TCP between different
addresses and interfaces, not over loopback. Both jobs must end with the same parameters as
the same jobs run on loopback by `psar run`.

Needs root on Linux with iproute2 (`ip netns`); skipped elsewhere. About 55 s on 2 shared
cores, half of it the loopback reference runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import forked
from conftest import max_param_diff
from experiments.runtime.netns import Network, NetworkError, unavailable

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
OVERRIDES = ("dtype=float64", "threads=1")
SETS = [arg for o in OVERRIDES for arg in ("--set", o)]
PS_PORT = 5555          # the namespaces are new, so fixed ports are free
MASTER_PORT = 29500
CHECK_PORT = 4000
JOB_DEADLINE_S = 150    # one multi-host job, from start to the last process's exit
TOL = 1e-10

# What a launcher may have set in the test's own environment must not leak into the workers.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "PSAR_MASTER_PORTS", "GLOO_SOCKET_IFNAME", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture(scope="module")
def net():
    reason = unavailable()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    network = Network(("a", "b", "c"))
    try:
        network.up()
    except NetworkError as err:
        pytest.fail(f"could not build the test network: {err}")
    try:
        network.check_tcp(CHECK_PORT)
        yield network
    finally:
        problems = network.down()
        assert not problems, "teardown left things behind: " + "; ".join(problems)


def POOL_JOBS() -> dict[str, dict]:
    """The loopback runs: local (the numerical reference), ps-sync and allreduce."""
    job = dict(experiment="quickstart", workers=2, steps=STEPS, overrides=OVERRIDES)
    return {e: dict(job, engine=e) for e in ("local", "ps-sync", "allreduce")}


@pytest.fixture(scope="module")
def reference(pool):
    return Reference({engine: state for engine, (_, state) in pool.results(__name__).items()})


class Reference(dict):
    """Final state_dict by loopback engine; short repr, so a failure's traceback stays readable."""

    def __repr__(self) -> str:
        return f"<loopback final parameters of {', '.join(self)}>"


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


class Job:
    """Processes of one multi-host job, each on its host, each writing its output to a log."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[tuple[str, forked.Forked, Path]] = []
        self.killed: set[int] = set()

    def start(self, name: str, host, args: list, env: dict[str, str]) -> None:
        log = self.log_dir / f"{name}.log"
        with open(log, "w") as f:
            proc = forked.psar(*args, env=env, wrap=tuple(host.argv()), output=f)
        self.procs.append((f"{name} on {host.netns} ({host.addr})", proc, log))

    def outputs(self) -> str:
        def status(proc):
            return "killed by the test" if proc.pid in self.killed else f"exit {proc.poll()}"
        return "\n".join(f"--- {name} ({status(proc)}):\n{log.read_text(errors='replace')[-4000:]}"
                         for name, proc, log in self.procs)

    def wait(self, deadline_s: float = JOB_DEADLINE_S) -> None:
        """Until every process has exited 0; the first failure or the deadline kills the rest
        and fails the test with everyone's output."""
        __tracebackhide__ = True
        end = time.monotonic() + deadline_s
        while True:
            codes = [proc.poll() for _, proc, _ in self.procs]
            failed = [name for (name, _, _), c in zip(self.procs, codes) if c not in (None, 0)]
            if failed:
                time.sleep(1)  # let the others print their side of it before they are killed
                self.kill()
                pytest.fail(f"{', '.join(failed)} failed:\n{self.outputs()}", pytrace=False)
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > end:
                self.kill()
                pytest.fail(f"the job did not end within {deadline_s} s:\n{self.outputs()}", pytrace=False)
            time.sleep(0.2)

    def kill(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
                self.killed.add(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def check_run(run_dir: Path, engine: str, reference: dict) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == engine
    assert summary["workers"] == 2 and summary["steps"] == STEPS, summary
    state = torch.load(run_dir / "model.pt", weights_only=True)
    for ref_engine in (engine, "local"):
        diff = max_param_diff(state, reference[ref_engine])
        assert diff <= TOL, (f"{engine} across hosts ends {diff:.3e} away from {ref_engine} on "
                             f"loopback (tolerance {TOL})")
    return summary


@pytest.mark.timeout(300)
def test_ps_sync_across_hosts(net, reference, tmp_path):
    a, b, c = (net.hosts[n] for n in "abc")
    address = f"tcp://{a.addr}:{PS_PORT}"
    job = Job(tmp_path / "logs")
    try:
        job.start("server", a, ["server", "--bind", address, "--experiment", "quickstart",
                                "--workers", 2, "--engine", "ps-sync", "--shard", "0/1", *SETS,
                                "--out", tmp_path / "host-a"], child_env())
        for rank, host in enumerate((b, c)):
            job.start(f"rank{rank}", host, ["worker", "quickstart", "--engine", "ps-sync",
                                            "--servers", address, "--rank", rank, "--world", 2,
                                            "--steps", STEPS, *SETS,
                                            "--out", tmp_path / f"host-{'bc'[rank]}"], child_env())
        job.wait()
    finally:
        job.kill()
    summary = check_run(tmp_path / "host-b", "ps-sync", reference)
    assert summary["servers"] == 1
    server = json.loads((tmp_path / "host-a/metrics/server0.json").read_text())
    assert server["result"] == "finished", server


@pytest.mark.timeout(300)
def test_allreduce_across_hosts(net, reference, tmp_path):
    b, c = net.hosts["b"], net.hosts["c"]
    job = Job(tmp_path / "logs")
    try:
        for rank, host in enumerate((b, c)):
            env = child_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=b.addr,
                            MASTER_PORT=str(MASTER_PORT), GLOO_SOCKET_IFNAME=host.ifname)
            job.start(f"rank{rank}", host, ["worker", "quickstart", "--engine", "allreduce",
                                            "--steps", STEPS, *SETS,
                                            "--out", tmp_path / f"host-{'bc'[rank]}"], env)
        job.wait()
    finally:
        job.kill()
    check_run(tmp_path / "host-b", "allreduce", reference)
