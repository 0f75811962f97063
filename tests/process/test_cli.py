"""The command line, through click's CliRunner and, for launchers, real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ps.cores import core_share, io_threads
import torch
from click.testing import CliRunner

from analysis.hostcpu import host_cpu
from analysis.results import load_run
from experiments.cli import main
from experiments.cli.options import describe_summary
from experiments.runtime.launcher import free_port
from experiments.settings.presets import PRESETS, build_config

ROOT_DIR = Path(__file__).resolve().parents[2]
RECORD_FIELDS = {"step", "time", "loss", "samples", "compute_s", "comm_s", "bytes_sent", "bytes_recv"}
SUMMARY_FIELDS = {"experiment", "engine", "workers", "steps", "seed", "final_loss", "eval",
                  "samples_per_sec", "wall_s", "bytes_per_worker_per_step", "param_sha256"}


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_list_names_every_experiment_and_engine():
    result = invoke("list")
    assert result.exit_code == 0
    for name in list(PRESETS) + ["local", "ddp", "allreduce"]:
        assert name in result.output
    # Which compressions each engine carries, from the registry.
    assert "ddp             torch DistributedDataParallel [compress.method: fp16, bf16, powersgd]" in result.output
    assert "[compress.method: fp16, bf16, topk, randomk, sign, qsgd, powersgd]" in result.output


@pytest.mark.parametrize("args,message", [
    (["run", "quickstart", "--set", "nope=1"], "unknown key 'nope'"),
    (["run", "quickstart", "--set", "optim.lr=fast"], "expected a number"),
    (["run", "quickstart", "--engine", "teleport"], "Invalid value for '--engine'"),
    (["run", "imagenet"], "'imagenet' is not one of"),
    (["compare", "quickstart", "--engines", "ddp,teleport"], "unknown engine(s) teleport"),
    (["compare", "quickstart", "--workers", "1,two"], "comma-separated"),
])
def test_bad_input_is_one_clear_line(args, message):
    result = invoke(*args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def _check_run_dir(run_dir: Path, experiment: str, engine: str, workers: int, steps: int):
    assert (run_dir / "config.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_FIELDS <= summary.keys()
    assert (summary["experiment"], summary["engine"], summary["workers"], summary["steps"]) == (
        experiment, engine, workers, steps)
    for rank in range(workers if engine != "local" else 1):
        records = [json.loads(line) for line in (run_dir / f"metrics/rank{rank}.jsonl").read_text().splitlines()]
        assert len(records) == steps and RECORD_FIELDS <= records[0].keys()
    state = torch.load(run_dir / "model.pt", weights_only=True)
    expected = build_config(experiment).model.build().state_dict().keys()
    assert list(state.keys()) == list(expected)  # the bare model's keys, no "module." prefix
    return summary


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_run_writes_the_run_directory(tmp_path):
    out = tmp_path / "run"
    result = invoke("run", "cnn", "--engine", "ddp", "--workers", 2, "--steps", 4, "--out", out)
    assert result.exit_code == 0, result.output
    assert f"run directory: {out}" in result.output
    summary = _check_run_dir(out, "cnn", "ddp", 2, 4)
    assert summary["bytes_per_worker_per_step"] > 0
    table = invoke("table", out)
    assert table.exit_code == 0 and "| ddp | 2 |" in table.output, table.output
    # The host's cores, read through the run: a share of them at work in its steps.
    cpu = host_cpu(load_run(out))
    assert cpu is not None and cpu["steps"] == 3 and 0 < cpu["busy"] <= 1 and cpu["cores"] >= 1, cpu
    assert "host cpu" in table.output
    # A finished run is never replaced unasked; --overwrite replaces it.
    before = (out / "summary.json").read_text()
    again = invoke("run", "cnn", "--engine", "ddp", "--workers", 2, "--steps", 2, "--out", out)
    assert again.exit_code == 1 and "holds a finished run" in again.output and "--overwrite" in again.output
    assert (out / "summary.json").read_text() == before
    replaced = invoke("run", "cnn", "--engine", "ddp", "--workers", 2, "--steps", 2, "--out", out, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_failing_worker_is_named_without_traceback(tmp_path):
    result = invoke("run", "quickstart", "--steps", 2, "--set", "batch_size=100000", "--out", tmp_path / "r")
    assert result.exit_code != 0
    assert re.search(r"rank [01] exited with code 1: psar: rank [01] failed: ValueError", result.output)
    assert "batch" in result.output.lower()
    assert "Traceback" not in result.output


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_torchrun_launches_the_worker_entry_point(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    out = tmp_path / "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "experiments.cli", "worker",
           "quickstart", "--engine", "allreduce", "--steps", "5", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    _check_run_dir(out, "quickstart", "allreduce", 2, 5)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_worker_reads_rank_and_world_from_the_environment(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    result = invoke("worker", "quickstart", "--engine", "allreduce", "--steps", 3, "--out",
                    tmp_path / "w", env=env)
    assert result.exit_code == 0, result.output
    assert "quickstart/allreduce x1: final loss" in result.output  # what `psar run` prints
    assert f"run directory: {tmp_path / 'w'}" in result.output
    _check_run_dir(tmp_path / "w", "quickstart", "allreduce", 1, 3)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_curve_keys_and_an_encrypted_run(tmp_path):
    result = invoke("keys", tmp_path / "keys", "--workers", "worker")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "keys/allowed/worker.key").exists()
    result = invoke("run", "quickstart", "--engine", "ps-sync", "--steps", 5, "--curve",
                    tmp_path / "keys", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "run/config.json").read_text())
    assert saved["ps"]["curve_dir"] == str((tmp_path / "keys").resolve())
    _check_run_dir(tmp_path / "run", "quickstart", "ps-sync", 2, 5)
    server = json.loads((tmp_path / "run/metrics/server0.json").read_text())
    share = core_share(saved["workers"] + saved["servers"])  # the launcher's processes share the cores
    assert (server["threads"], server["io_threads"]) == (share, io_threads(share, 2)), server
    assert server["torch_threads"] == 1, server  # SGD: large keys on the shard's own threads


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_compare_reports_a_failed_cell_and_goes_on(tmp_path):
    # ddp refuses an injected message delay (its messages are inside torch); local runs.
    result = invoke("compare", "quickstart", "--engines", "ddp,local", "--workers", 2, "--steps", 3,
                    "--set", "fault.delay_ms=1", "--no-plots", "--out", tmp_path / "cmp")
    assert result.exit_code == 1, result.output
    assert "1 of 2 runs failed (ddp x2)" in result.output
    table = (tmp_path / "cmp/summary.md").read_text()
    ddp, = [line for line in table.splitlines() if line.startswith("| ddp ")]
    assert "failed: rank" in ddp and "fault.delay_ms cannot be applied to ddp" in ddp
    local, = [line for line in table.splitlines() if line.startswith("| local ")]
    assert "failed" not in local
    assert (tmp_path / "cmp/runs/local-w2/summary.json").exists()


@pytest.mark.timeout(60)
def test_worker_by_hand_checks_its_rendezvous_and_addresses_up_front(tmp_path):
    env = {"MASTER_ADDR": "", "MASTER_PORT": ""}
    result = invoke("worker", "quickstart", "--engine", "allreduce", "--rank", 0, "--world", 1,
                    "--out", tmp_path / "w", env=env)
    assert result.exit_code == 2 and "set MASTER_ADDR and MASTER_PORT" in result.output
    for address, message in [("tcp://127.0.0.1:99999", "port '99999' is not a number from 1 to 65535"),
                             ("tcp://no-such-host.invalid:5555", "does not resolve")]:
        result = invoke("worker", "quickstart", "--engine", "ps-sync", "--servers", address,
                        "--rank", 0, "--world", 1, "--out", tmp_path / "w")
        assert result.exit_code == 2 and message in result.output, result.output
    text = "".join(invoke("server", "--help").output.split())  # however click wraps it
    assert "--engine[ps-sync|ps-async|ps-ssp|ps-easgd]Gradientsynchronisationengine[default:ps-sync]" in text
    assert "withinps.timeout_s" in text


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_resume_never_damages_results_already_there(tmp_path):
    done, bare = tmp_path / "done", tmp_path / "bare"
    for run_dir, sets in ((done, ["--set", "checkpoint.every=2"]), (bare, [])):
        result = invoke("run", "quickstart", "--engine", "local", "--workers", 1, "--steps", 4,
                        "--out", run_dir, *sets)
        assert result.exit_code == 0, result.output
    before = {p: p.read_bytes() for d in (done, bare) for p in d.rglob("*") if p.is_file()}
    result = invoke("run", "--resume", done)
    assert result.exit_code == 1 and "add --out NEW_DIR" in result.output
    result = invoke("run", "--resume", bare, "--steps", 6, "--out", tmp_path / "nowhere")
    assert result.exit_code == 1 and "no checkpoint" in result.output and "checkpoint.every" in result.output
    assert not (tmp_path / "nowhere").exists()
    assert {p: p.read_bytes() for d in (done, bare) for p in d.rglob("*") if p.is_file()} == before
    result = invoke("run", "--resume", done, "--steps", 6, "--out", tmp_path / "more")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "more/summary.json").read_text())["steps"] == 6
    assert {p: p.read_bytes() for d in (done, bare) for p in d.rglob("*") if p.is_file()} == before


def test_run_line_says_why_a_figure_is_missing():
    summary = {"experiment": "logreg-sparse", "engine": "ps-async", "workers": 2, "final_loss": 0.69,
               "eval": {"accuracy": 0.5}, "samples_per_sec": None}
    line = describe_summary(summary)
    assert line.startswith("logreg-sparse/ps-async x2: final loss 0.6900, eval accuracy 0.5000")
    assert "samples/s not measured" in line


def test_flags_win_over_a_named_comparison(monkeypatch, tmp_path):
    import experiments.comparisons.runner

    seen = {}

    def grid(experiment, variants, workers, out, overrides, steps, *args, **kwargs):
        seen.update(experiment=experiment, engines=[v.engine for v in variants], workers=workers, steps=steps,
                    overrides=overrides)
        return [], []

    monkeypatch.setattr(experiments.comparisons.runner, "run_grid", grid)
    result = invoke("compare", "straggler", "--steps", 15, "--engines", "ps-async", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert seen["steps"] == 15 and seen["engines"] == ["ps-async"] and seen["experiment"] == "cnn"
    assert not any(o.startswith("steps=") for o in seen["overrides"])
    invoke("compare", "straggler", "--out", tmp_path)
    assert seen["steps"] == 60
    # Every cell's workers get the threads of the largest cell's: a 1-worker run does not
    # take every core (its speed-up would read above the worker count on a busy machine).
    invoke("compare", "straggler", "--workers", "1,4", "--out", tmp_path)
    assert f"threads={max(1, (os.cpu_count() or 1) // 4)}" in seen["overrides"]
    invoke("compare", "straggler", "--workers", "1,4", "--set", "threads=3", "--out", tmp_path)
    assert [o for o in seen["overrides"] if o.startswith("threads=")] == ["threads=3"]


def test_compare_takes_a_script_with_its_arguments(monkeypatch, tmp_path):
    import experiments.comparisons.runner

    seen = {}

    def grid(experiment, variants, workers, out, overrides, steps, *args, script=None, **kwargs):
        seen.update(engines=[v.engine for v in variants], script=script)
        return [], []

    monkeypatch.setattr(experiments.comparisons.runner, "run_grid", grid)
    script = tmp_path / "train.py"
    script.write_text("")
    result = invoke("compare", script, "--args", "--epochs 1 --lr '0.5'", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert seen["script"] == [str(script), "--epochs", "1", "--lr", "0.5"]
    assert "local" not in seen["engines"] and "allreduce" in seen["engines"]
    for argv, message in [((script, "--engines", "local"), "local runs every worker in one process"),
                          ((script, "--steps", 5), "a script decides its own steps"),
                          ((tmp_path / "none.py",), "does not exist"),
                          (("quickstart", "--args", "-x"), "--args is for a script"),
                          (("nonsense",), "neither an experiment")]:
        result = invoke("compare", *argv, "--out", tmp_path / "out")
        assert result.exit_code != 0 and message in result.output, (argv, result.output)


def test_compare_never_replaces_an_earlier_comparison_unasked(monkeypatch, tmp_path):
    """--out holding an earlier comparison's runs is refused before anything runs; with
    --overwrite its runs are replaced, and the command says so."""
    import experiments.comparisons.runner

    started = []
    monkeypatch.setattr(experiments.comparisons.runner, "run_grid", lambda *a, **k: started.append(1) or ([], []))
    earlier = tmp_path / "cmp" / "runs" / "allreduce-w2"
    earlier.mkdir(parents=True)
    (earlier / "summary.json").write_text("{}")
    result = invoke("compare", "quickstart", "--engines", "allreduce", "--out", tmp_path / "cmp")
    assert result.exit_code == 1 and "holds the runs of an earlier comparison (1 in" in result.output
    assert "--overwrite" in result.output and not started and earlier.exists()
    result = invoke("compare", "quickstart", "--engines", "allreduce", "--out", tmp_path / "cmp", "--overwrite")
    assert result.exit_code == 0, result.output
    assert "replacing the 1 runs of an earlier comparison" in result.output and started and not earlier.exists()


def test_table_names_every_run_it_leaves_out(tmp_path):
    """A folder of runs with a finished, a failed, an unfinished run and a stray folder: the
    table shows the finished one and says why each other one is not in it."""
    src = tmp_path / "done"
    assert invoke("run", "quickstart", "--engine", "local", "--workers", 1, "--steps", 3, "--out", src).exit_code == 0
    folder = tmp_path / "many"
    folder.mkdir()
    shutil.copytree(src, folder / "done")
    for name, log in (("failed", "psar: rank 1 exited with code 1\n"), ("running", "step 3\n")):
        (folder / name / "logs").mkdir(parents=True)
        shutil.copy(src / "config.json", folder / name / "config.json")
        (folder / name / "logs" / "rank0.log").write_text(log)
    (folder / "notes").mkdir()
    result = invoke("table", folder)
    assert result.exit_code == 0, result.output
    assert "| local | 1 |" in result.output
    said = result.stderr  # the table alone on stdout
    assert f"skipped {folder / 'failed'}: failed: rank 1 exited with code 1" in said
    assert f"skipped {folder / 'running'}: unfinished (no summary.json)" in said
    assert f"skipped {folder / 'notes'}: not a run (no config.json)" in said


def test_a_bad_rate_is_named_as_the_flag_given(tmp_path):
    result = invoke("run", "quickstart", "--net", "fast", "--out", tmp_path / "x")
    assert result.exit_code == 2 and "'--net': rate 'fast'" in result.output and "net.rate" not in result.output


def test_a_grid_says_what_its_overrides_change_of_the_model(monkeypatch, tmp_path):
    """The period comparison trains mlp-mid with model.hidden=[512,512]: its lines say so."""
    import experiments.comparisons.runner as runner

    monkeypatch.setattr(runner, "launch_batch", lambda *a, **k: None)
    said = []
    runner.run_grid("mlp-mid", [runner.Variant("allreduce")], [2], tmp_path, ("model.hidden=[512,512]",), steps=2,
                    echo=said.append)
    assert said and said[0].startswith("running mlp-mid model.hidden=[512,512] with allreduce on 2 worker(s)")


def test_a_cuda_run_that_cannot_run_is_refused_before_anything_starts(tmp_path):
    """No CUDA device: refused, no run directory left behind. allreduce and ddp with more
    workers than GPUs: refused naming the way out; ps-* share GPUs."""
    from experiments.runtime.launcher import LaunchError, check_devices

    if not torch.cuda.is_available():
        result = invoke("run", "quickstart", "--device", "cuda", "--workers", 2, "--out", tmp_path / "x")
        assert result.exit_code == 1 and "torch sees no CUDA device" in result.output
        assert not (tmp_path / "x").exists()
    for engine in ("allreduce", "ddp"):
        cfg = build_config("quickstart", (), engine=engine, workers=2, device="cuda")
        with pytest.raises(LaunchError, match="this host has 1 for 2 workers: use at most 1 workers, a ps-"):
            check_devices(cfg, count=lambda: 1)
        check_devices(cfg, count=lambda: 2)
    check_devices(build_config("quickstart", (), engine="ps-sync", workers=4, device="cuda"), count=lambda: 1)
    with pytest.raises(LaunchError, match="no CUDA device"):
        check_devices(build_config("quickstart", (), engine="ps-sync", workers=2, device="cuda"), count=lambda: 0)


def test_the_command_list_cuts_no_summary_and_imports_no_torch():
    from experiments.cli import COMMANDS, SUMMARIES

    result = invoke("--help")
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1]
    assert "..." not in commands and len(re.findall(r"^  \w", commands, flags=re.M)) == len(COMMANDS)
    assert set(SUMMARIES) == set(COMMANDS)
    # psar --help, psar list and every command's --help, one after the other in one process
    calls = [["--help"], ["list"]] + [[name, "--help"] for name in sorted(COMMANDS)]
    code = (f"import sys\nfrom experiments.cli import main\nfor args in {calls!r}:\n    try:\n"
            "        main(args)\n    except SystemExit as e:\n        assert not e.code, (args, e.code)\n"
            "print(sorted(m for m in ('torch', 'numpy', 'zmq', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT_DIR)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
    for name in COMMANDS:  # every command loads and has its own help
        assert invoke(name, "--help").exit_code == 0, name
