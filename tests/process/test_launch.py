"""A user's own script: `psar launch` runs experiments/examples/convnet_psar.py on allreduce,
ddp and ps-sync (two shards), and torchrun runs it on allreduce; in float64 all end with the
same parameters. A script that fails is named with its rank and error; misuse of the API and
bad command lines get one-line errors."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import max_param_diff, started

from experiments.api import script_config
from experiments.cli import main
from experiments.runtime.launcher import LaunchError, launch_batch
from experiments.runtime.sites import ephemeral_range, free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "experiments" / "examples" / "convnet_psar.py"
ARGS = ["--float64", "--steps", "12"]
ENGINES = {"allreduce": {}, "ddp": {}, "ps-sync": {"servers": 2}}


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_are_never_given_twice():
    # A batch's later jobs bind theirs minutes after they were chosen: the kernel must not
    # hand them meanwhile to a connection or to a listening socket on port 0.
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


@pytest.fixture(scope="module")
def launched(runs_dir):
    out = {}
    for engine, extra in ENGINES.items():
        cfg = script_config(str(SCRIPT), ARGS, engine=engine, workers=2, **extra)
        run_dir = runs_dir / "launch" / engine
        out[engine] = (launch_batch([(cfg, run_dir)], deadline_s=120, quiet=True, script=[str(SCRIPT), *ARGS])[0],
                       torch.load(run_dir / "model.pt", weights_only=True))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_every_engine_runs_the_script_to_the_same_parameters(launched):
    _, ref = launched["allreduce"]
    assert ref["0.weight"].dtype == torch.float64
    for engine, (summary, state) in launched.items():
        assert summary["engine"] == engine and summary["workers"] == 2 and summary["steps"] == 12
        assert summary["experiment"] == "script:convnet_psar.py"
        assert max_param_diff(ref, state) < 1e-10, engine
    assert len(launched["ps-sync"][0]["server_stats"]) == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_the_script_under_torchrun_matches(launched, tmp_path):
    port = free_port()
    proc = started(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(SCRIPT), *ARGS], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    output, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, output
    state = torch.load(tmp_path / "runs" / "convnet_psar" / "model.pt", weights_only=True)
    assert max_param_diff(launched["allreduce"][1], state) < 1e-10


FAILING = """
import torch
from experiments import api as psar
job = psar.init()
raise ValueError(f"no data for rank {job.rank}")
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_failing_script_is_named_with_its_rank_and_error(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    cfg = script_config(str(script), engine="allreduce", workers=2, overrides=("timeout_s=10",))
    with pytest.raises(LaunchError) as err:
        launch_batch([(cfg, tmp_path / "run")], deadline_s=150, quiet=True, script=[str(script)])
    line = str(err.value)
    rank = line.split()[1]
    assert "\n" not in line and line.startswith(f"rank {rank} exited with code 1:")
    assert f"ValueError: no data for rank {rank}" in line


FAILS_AT_STEP_3 = """
import time
import torch
from experiments import api as psar
job = psar.init()
model = job.attach(torch.nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
for step in range(10):
    print(f"rank {job.rank} at step {step}", flush=True)
    if step == 3 and job.rank == 1:
        open(STAMP, "w").write(repr(time.time()))
        raise ValueError("bad batch at step 3")
    job.backward(model(torch.ones(2, 4)).sum())
    job.step()
job.close()
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_script_failing_under_ps_sync_is_reported_in_seconds_with_what_it_printed(tmp_path, capsys):
    """Rank 0's prints reach the terminal; the failure is reported within the launcher's
    grace after it happens (the other worker and the shard wait on it); the shard's log says
    why it was stopped, above its stacks."""
    from experiments.runtime.launcher import FAILURE_GRACE_S, STACK_DUMP_S

    stamp = tmp_path / "failed_at"
    script = tmp_path / "fails.py"
    script.write_text(FAILS_AT_STEP_3.replace("STAMP", repr(str(stamp))))
    cfg = script_config(str(script), engine="ps-sync", workers=2, servers=1)
    with pytest.raises(LaunchError) as err:
        launch_batch([(cfg, tmp_path / "run")], deadline_s=150, script=[str(script)])
    reported = time.time() - float(stamp.read_text())
    assert "rank 1 exited with code 1" in str(err.value) and "bad batch at step 3" in str(err.value)
    assert reported < FAILURE_GRACE_S + STACK_DUMP_S + 3.0, reported
    assert "rank 0 at step 0" in capsys.readouterr().out
    log = (tmp_path / "run" / "logs" / "server0.log").read_text()
    assert "psar: server 0 stopped by the launcher because rank 1 exited with code 1" in log


MISUSE = """
import torch
from experiments import api as psar
job = psar.init(engine="allreduce", out={out!r})
for call in (lambda: job.step(), lambda: job.backward(torch.zeros(()))):
    try:
        call()
    except RuntimeError as e:
        print("refused:", e)
model = job.attach(torch.nn.Linear(3, 1).double(), lambda p: torch.optim.SGD(p, lr=0.1))
try:
    job.attach(model, lambda p: torch.optim.SGD(p, lr=0.1))
except RuntimeError as e:
    print("refused:", e)
try:
    job.step()
except RuntimeError as e:
    print("refused:", e)
job.backward(model(torch.ones(4, 3, dtype=torch.float64)).sum())
print("record:", sorted(job.step()))
job.close()
try:
    job.backward(model(torch.ones(4, 3, dtype=torch.float64)).sum())
except RuntimeError as e:
    print("refused:", e)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_api_misuse_is_a_clear_error(tmp_path):
    script = tmp_path / "misuse.py"
    script.write_text(MISUSE.format(out=str(tmp_path / "run")))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    env.pop("PSAR_RUN_DIR", None)
    proc = started(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    output, _ = proc.communicate(timeout=100)
    assert proc.returncode == 0, output
    refused = [line for line in output.splitlines() if line.startswith("refused:")]
    assert refused == ["refused: step() now: call attach(model, make_optimizer) first",
                       "refused: backward() now: call attach(model, make_optimizer) first",
                       "refused: attach() now: attach() was already called; it is called once",
                       "refused: step() before backward(loss): there is no gradient to apply",
                       "refused: backward() now: the job is closed"], output
    assert "'loss'" in next(line for line in output.splitlines() if line.startswith("record:"))
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "metrics" / "rank0.jsonl").exists()


@pytest.mark.parametrize("argv,message", [
    (["launch", "no-such-script.py"], "script no-such-script.py does not exist"),
    (["launch", "--engine", "local", str(SCRIPT)], "'local' is not one of"),
    (["launch", "--workers", "0", str(SCRIPT)], "workers=0: must be >= 1"),
    (["launch", "--set", "allreduce.algorithm=star", str(SCRIPT)], "allreduce.algorithm='star'"),
])
def test_bad_command_lines_get_one_line_errors(argv, message):
    result = CliRunner().invoke(main, argv)
    assert result.exit_code != 0
    assert message in result.output, result.output


@pytest.mark.parametrize("nodelist,host", [("node07", "node07"), ("gpu[03-05,09],cpu1", "gpu03"),
                                           ("n[1-4]", "n1"), ("rack2-[10,12]-ib,x9", "rack2-10-ib")])
def test_slurm_rendezvous_is_the_first_host_of_the_job(monkeypatch, nodelist, host):
    from experiments.harness.distenv import SLURM_PORT, DistEnv

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    env = DistEnv.from_environ()
    assert (env.rank, env.world, env.local_rank, env.master) == (3, 4, 1, f"{host}:{SLURM_PORT}")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_psar_server_and_workers_started_by_hand_match_launch(launched, tmp_path):
    """As the sbatch script of docs/your-own-script.md does it: `psar server --script` on one
    host, the workers with RANK/WORLD_SIZE (or Slurm's), PSAR_ENGINE and PSAR_SERVERS on others."""
    port, master = free_port(), free_port()
    psar = Path(sys.executable).parent / "psar"
    started(subprocess.Popen([str(psar), "server", "--script", str(SCRIPT), "--engine", "ps-sync", "--workers", "2",
                              "--bind", f"tcp://127.0.0.1:{port}", "--out", str(tmp_path / "shard")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
               PSAR_ENGINE="ps-sync", PSAR_SERVERS=f"tcp://127.0.0.1:{port}")
    env.pop("PSAR_RUN_DIR", None)
    workers = [started(subprocess.Popen([sys.executable, str(SCRIPT), *ARGS], cwd=tmp_path, text=True,
                                        env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)) for r in range(2)]
    for w in workers:
        output, _ = w.communicate(timeout=150)
        assert w.returncode == 0, output
    state = torch.load(tmp_path / "runs" / "convnet_psar" / "model.pt", weights_only=True)
    assert max_param_diff(launched["ps-sync"][1], state) < 1e-10


@pytest.mark.timeout(60)
def test_a_process_held_when_its_job_fails_writes_its_stacks_before_it_is_killed(tmp_path):
    """One process fails; the other, held in a sleep, is killed after the grace period, and
    first writes where each of its threads stands to its log (SIGUSR1, faulthandler)."""
    from experiments.runtime import launcher

    held = ("import faulthandler, signal, time\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
            "def held_in_teardown():\n    time.sleep(60)\n"
            "held_in_teardown()\n")
    procs = [("rank 0", [sys.executable, "-c", "import sys; sys.exit(3)"], dict(os.environ)),
             ("rank 1", [sys.executable, "-c", held], dict(os.environ))]
    with pytest.raises(LaunchError, match="rank 0 exited with code 3"):
        launcher.run_processes(procs, tmp_path)
    log = (tmp_path / "rank1.log").read_text()
    assert "in held_in_teardown" in log and "Current thread" in log
