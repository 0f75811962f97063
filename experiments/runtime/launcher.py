"""Starts the processes of a run on this machine and watches them until they end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ps.cores import LOCAL_PROCESSES

from experiments.rundir import files
from experiments.rundir.checkpoint import CHECKPOINT_DIR, server_path, worker_path
from experiments.settings.config import RunConfig
from experiments.engines import get_engine
from experiments.runtime.cpumeter import CPU_FILE, CpuMeter, allowed_cpus
from experiments.runtime.linkmeter import LINKS_FILE
from experiments.runtime.sites import Loopback, sites_for
from experiments.runtime.sites import free_port  # noqa: F401 (callers take it from here)
from experiments.rundir.trace import merge as merge_trace
from experiments.harness.distenv import RESTARTS_ENV
from experiments.harness.loop import prepare_run_dir
from experiments.runtime.restarts import Restarts, check_restartable
from experiments.runtime.worker import SERVERS_FILE
from experiments.runtime.zygote import Forked, Zygote, can_fork, shared as shared_zygote

RUN_DIR_ENV = "PSAR_RUN_DIR"
"""A script's workers find their run directory (config.json, servers.json) here."""
RESUME_ENV = "PSAR_RESUME"
"""Set to 1 when a script's workers continue from their checkpoints (psar launch --resume)."""


class LaunchError(RuntimeError):
    """A process of the run failed; the message names it and quotes its last words.
    failed_at: the wall time the launcher saw it fail (None: the run was out of time)."""

    def __init__(self, text: str, failed_at: float | None = None) -> None:
        super().__init__(text)
        self.failed_at = failed_at


def _tail(path: Path, lines: int = 3) -> str:
    """The worker's own one-line account of its failure, else the log's last lines."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    own = [line for line in text if line.startswith("psar: ")]
    return own[-1] if own else " | ".join(text[-lines:])


def launch(cfg: RunConfig, run_dir: Path, deadline_s: float | None = None,
           quiet: bool = False, resume: bool = False, max_restarts: int | None = None) -> dict:
    """Run `cfg` on loopback, one process per worker; return summary.json's contents.

    deadline_s bounds the whole run (tests use it so that a hang fails fast); without it,
    each process's own timeouts (cfg.timeout_s) bound every wait on a peer.
    max_restarts: see launch_batch.
    """
    return launch_batch([(cfg, run_dir)], deadline_s, quiet, resume, max_restarts=max_restarts)[0]


def launch_batch(jobs: list[tuple[RunConfig, Path]], deadline_s: float | None = None,
                 quiet: bool = False, resume: bool = False, script: list[str] | None = None,
                 max_restarts: int | None = None) -> list[dict]:
    """Run several configs one after another in the same processes.

    The processes serve all of them, so a batch pays their start-up (forks from the zygote,
    or an import of torch each on an emulated network) once.
    Every job must need the same processes: workers, and server shards for the ps engines.
    resume: continue each run from its checkpoints, in its own directory, on new ports.
    script: [SCRIPT, ARGS...] a user's training script each worker runs in place of psar's
    loop (one job; the script finds the run directory in $PSAR_RUN_DIR and whether it resumes
    in $PSAR_RESUME, see experiments.api).
    max_restarts: when a worker fails, stop every worker and start them all again from the
    checkpoint they share (or from the start without one), as torchrun does; under the
    parameter servers start the dead worker alone, which rejoins the running shards; at most
    this many times (experiments/runtime/restarts.py); one job. summary.json then says what
    the restarts cost. None: a failure fails the run.
    """
    if (script is not None or max_restarts is not None) and len(jobs) != 1:
        raise ValueError("a script, or a run with restarts, runs one job")
    shapes = {process_shape(cfg) for cfg, _ in jobs}
    if len(shapes) != 1:
        raise ValueError(f"jobs of one batch need the same processes, got {sorted(shapes)}")
    if len(jobs) > 1 and any(cfg.net.rate for cfg, _ in jobs):  # each its own network and counters
        return [launch_batch([job], deadline_s, quiet, resume)[0] for job in jobs]
    nprocs, nservers = shapes.pop()
    for cfg, _ in jobs:  # before any process starts or anything is written
        check_devices(cfg)
    if max_restarts is not None:
        check_restartable(jobs[0][0])
    for cfg, run_dir in jobs if resume else []:  # before anything in the run directory changes
        require_checkpoints(cfg, run_dir)
    with sites_for(jobs[0][0].net, nprocs, nservers) as sites:
        run_dirs = [prepare_run_dir(sites.adjust(cfg), run_dir) for cfg, run_dir in jobs]
        for run_dir in run_dirs if nservers else []:
            addresses = [f"tcp://{sites.server(s).addr}:{sites.server_port(s)}" for s in range(nservers)]
            files.write_json(run_dir / SERVERS_FILE, addresses)
        dirs = [str(d) for d in run_dirs]
        again = ["--resume"] if resume else []
        servers = [(f"server {s}", sites.server(s).wrap([sys.executable, "-m", "experiments.runtime.shard",
                                                          *again, str(s), *dirs]),
                    dict(_job_env(sites, nprocs), **{LOCAL_PROCESSES: str(nprocs + nservers)}))
                   for s in range(nservers)]
        restarts = Restarts(run_dirs[0], nprocs, max_restarts) if max_restarts is not None else None
        started, attempt = time.monotonic(), 0

        def ranks(attempt: int, again: list[str]) -> list[tuple[str, list[str], dict[str, str]]]:
            base = _job_env(sites, nprocs, attempt)
            worker = [sys.executable, *script] if script else \
                [sys.executable, "-m", "experiments.runtime.worker", *again, *dirs]
            if script:
                base[RUN_DIR_ENV] = dirs[0]
                base[RESUME_ENV] = "1" if again else "0"
            return _rank_procs(sites, worker, nprocs, base)

        def rejoin(name: str, failure: str, failed_at: float):
            """Under the parameter servers a dead worker alone starts again and rejoins."""
            if not (nservers and restarts is not None and restarts.left and name.startswith("rank ")):
                return None
            rank = int(name.split()[1])
            restarts.failed_one(rank, failure, failed_at)
            if not quiet:
                print(f"psar: {failure}; starting rank {rank} again ({restarts.count} of {max_restarts}), "
                      "to rejoin the shards", file=sys.stderr)
            _, argv, env = ranks(restarts.count, [])[rank]
            return argv, env

        cpu = _cpu_meter(quiet)
        try:
            while True:
                procs = (servers if attempt == 0 else []) + ranks(attempt, again)
                left = None if deadline_s is None else deadline_s - (time.monotonic() - started)
                try:
                    run_processes(procs, run_dirs[0] / "logs", left, show_progress=not quiet,
                                  append=resume or attempt > 0, echo_rank0=script is not None and not quiet,
                                  restarting=restarts is not None and restarts.left and not nservers,
                                  respawn=rejoin, fork=attempt == 0, watch=cpu.watch if cpu else None)
                    break
                except LaunchError as err:
                    if restarts is None or not restarts.left or err.failed_at is None or nservers:
                        raise
                    step = restarts.failed(str(err), err.failed_at)
                    again = ["--resume"] if step is not None else []
                    attempt += 1
                    if not quiet:
                        print(f"psar: {err}; restarting every worker ({attempt} of {max_restarts}) from "
                              f"{f'the checkpoint of step {step}' if step is not None else 'the start'}",
                              file=sys.stderr)
        finally:
            cores = cpu.finish(CPU_FILE, quiet) if cpu is not None else None
        timeline = sites.links()
        network = sites.record()
    summaries = []
    for (cfg, _), run_dir in zip(jobs, run_dirs):
        if cfg.trace:
            merge_trace(run_dir)  # now with the servers' events too
        if not (run_dir / "summary.json").exists():  # a script that returned without close()
            raise LaunchError(f"every process exited 0 but rank 0 wrote no {run_dir / 'summary.json'}: "
                              "does the script call job.close() at the end?")
        summary = json.loads((run_dir / "summary.json").read_text())
        if network is not None:
            summary["network"] = network
        if restarts is not None:
            summary.update(restarts.finished())
        if network is not None or restarts is not None:
            files.write_json(run_dir / "summary.json", summary)
        if timeline is not None:
            files.write_json(run_dir / LINKS_FILE, timeline, indent=None)
        if cores is not None:
            files.write_json(run_dir / CPU_FILE, cores, indent=None)
        summaries.append(summary)
    return summaries


def _cpu_meter(quiet: bool) -> CpuMeter | None:
    """The host's CPU counters read from now on (cpumeter.CpuMeter); None, said on stderr
    unless quiet, where they cannot be read (the run goes on without its cpu.json)."""
    try:
        return CpuMeter(cpus=allowed_cpus()).start()
    except Exception as err:  # RuntimeError where no thread can start: the run goes on all the same
        if not quiet:
            print(f"psar: no {CPU_FILE}: {err}", file=sys.stderr)
        return None


def check_devices(cfg: RunConfig, count: Callable[[], int] | None = None) -> None:
    """LaunchError before anything starts where --device cuda cannot run: no CUDA device on
    this host, or allreduce and ddp with more workers than GPUs (NCCL cannot put two ranks on
    one GPU). count: the host's CUDA devices (default: torch's count)."""
    if cfg.device != "cuda":
        return
    import torch

    gpus = count() if count is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not gpus:
        raise LaunchError("--device cuda was asked for, but torch sees no CUDA device on this host: "
                          "use --device cpu")
    if get_engine(cfg.engine).rendezvous and cfg.workers > gpus:
        raise LaunchError(f"{cfg.engine} on --device cuda puts each worker on a GPU of its own (NCCL cannot "
                          f"put two ranks on one), and this host has {gpus} for {cfg.workers} workers: use at "
                          f"most {gpus} workers, a ps-* engine (its workers share GPUs), or --device cpu")


def _job_env(sites, nprocs: int, restarts: int = 0) -> dict[str, str]:
    """The environment every process of a job of nprocs ranks shares (env:// rendezvous at
    rank 0's site, a new one after each restart; the restarts so far, as torchrun says them)."""
    return dict(os.environ, WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                MASTER_ADDR=sites.worker(0).addr, MASTER_PORT=str(sites.master_port(restarts)), PYTHONUNBUFFERED="1",
                **{RESTARTS_ENV: str(restarts), "TORCHELASTIC_RESTART_COUNT": str(restarts)})


def _rank_procs(sites, argv: list[str], nprocs: int, base: dict[str, str]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, env) of ranks 0..nprocs-1, each at its site. On an emulated host Gloo must
    use the host's link, not whatever its hostname resolves to."""
    procs = []
    for r in range(nprocs):
        site = sites.worker(r)
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append((f"rank {r}", site.wrap(argv), dict(env, GLOO_SOCKET_IFNAME=site.ifname) if site.ifname else env))
    return procs


def require_checkpoints(cfg: RunConfig, run_dir: Path) -> None:
    """Raise FileNotFoundError naming the checkpoints a resume of cfg in run_dir lacks."""
    nprocs, nservers = process_shape(cfg)
    needed = [worker_path(run_dir, r) for r in range(nprocs)]
    needed += [server_path(run_dir, s) for s in range(nservers)]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise FileNotFoundError(f"cannot resume {run_dir}: no checkpoint {', '.join(missing)} (was it "
                                "run with --set checkpoint.every=K, and did it reach step K?)")


def resumable_copy(cfg: RunConfig, run_dir: Path, out: Path) -> Path:
    """Copy what a resume of run_dir needs (config, checkpoints, metrics) to the new run
    directory `out`, leaving run_dir untouched; return out."""
    run_dir, out = Path(run_dir), Path(out)
    require_checkpoints(cfg, run_dir)
    if out.exists():
        raise FileExistsError(f"--out {out} already exists: name a new directory for the resumed copy")
    out.mkdir(parents=True)
    shutil.copy2(run_dir / "config.json", out / "config.json")
    for folder in (CHECKPOINT_DIR, "metrics"):
        shutil.copytree(run_dir / folder, out / folder, ignore=shutil.ignore_patterns("server*.json"))
    return out


def process_shape(cfg: RunConfig) -> tuple[int, int]:
    """(worker processes, server processes) that a run of cfg needs on this machine."""
    spec = get_engine(cfg.engine)
    return (cfg.workers if spec.processes_per_worker else 1, cfg.servers if spec.uses_servers else 0)


def run_ranks(argv: list[str], nprocs: int, log_dir: Path, deadline_s: float | None = None,
              show_progress: bool = False, env: dict[str, str] | None = None, sites=None) -> None:
    """Start `argv` as ranks 0..nprocs-1 of a job and wait until all exit 0: on loopback, or
    rank r on sites.worker(r) of an entered Sites (experiments/runtime/sites.py)."""
    sites = sites or Loopback()
    base = dict(_job_env(sites, nprocs), **(env or {}))
    run_processes(_rank_procs(sites, argv, nprocs, base), log_dir, deadline_s, show_progress)


STACK_DUMP_S = 0.5
"""How long a process still running when its job has failed gets to write its threads' stacks
to its log (SIGUSR1, faulthandler) before it is killed."""
FAILURE_GRACE_S = 2.0
"""After one process failed, how long the others get to end by themselves (and write why)
before they are stopped: a failing script is reported within a few seconds on every engine
(10 s made a ps-sync script's failure at step 3 take 16 s)."""


def run_processes(procs: list[tuple[str, list[str], dict[str, str]]], log_dir: Path,
                  deadline_s: float | None = None, show_progress: bool = False,
                  append: bool = False, echo_rank0: bool = False, restarting: bool = False,
                  respawn: Callable[[str, str, float], tuple[list[str], dict[str, str]] | None] | None = None,
                  fork: bool = True, watch: Callable[[str, int], None] | None = None) -> None:
    """Start (name, argv, env) processes and wait until all exit 0.

    Each one's output goes to log_dir/<name>.log (rank 0's stderr stays on the terminal when
    it is one, for the progress bar); append: after what is there (a resumed run's logs keep
    the first part's); echo_rank0: rank 0's stdout also reaches this terminal (a user's
    script prints there). A failing process fails the job, naming it; the logs of those then
    stopped say why, above their threads' stacks. restarting: the job will be started again,
    so the others are stopped at once, without their stacks. respawn(name, failure, failed_at):
    for a process that failed, the (argv, env) to start in its place (its log goes on), or
    None: then its failure fails the job. fork: start them from the zygote where it can (a
    restarted job's processes, and one started in a failed one's place, start as torchrun
    starts them, fresh interpreters, so that a restart's time is what it would be there).
    watch(name, pid): told of each process as it starts (the CPU meter counts its time).
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    tty = show_progress and sys.stderr.isatty()
    started: list[tuple[str, subprocess.Popen | Forked, Path]] = []
    echoes: list[threading.Thread] = []
    why = "the launcher was interrupted"
    # Processes of this interpreter fork from one that has imported torch once.
    zygote = shared_zygote(procs[0][2]) if procs and fork and all(can_fork(argv) for _, argv, _ in procs) else None

    def spawn(name: str, argv: list[str], env: dict[str, str], fresh: bool,
              forked: bool = True) -> subprocess.Popen | Forked:
        log_path = log_dir / f"{name.replace(' ', '')}.log"
        echo = echo_rank0 and name == "rank 0"
        if fresh:
            open(log_path, "w").close()
        with open(log_path, "a") as log:  # appending: the launcher's own lines are never overwritten
            proc = _start(zygote if forked else None, argv, env, log, echo, stderr_tty=name == "rank 0" and tty)
        if echo:
            echoes.append(threading.Thread(target=_tee, args=(proc.stdout, log_path), daemon=True))
            echoes[-1].start()
        started.append((name, proc, log_path))
        if watch is not None:
            watch(name, proc.pid)
        return proc

    def again(name: str, failure: str, failed_at: float) -> subprocess.Popen | Forked | None:
        replacement = respawn(name, failure, failed_at) if respawn is not None else None
        if replacement is None:
            return None
        started[:] = [entry for entry in started if entry[0] != name]
        return spawn(name, *replacement, fresh=False, forked=False)  # a restart starts as torchrun's do

    try:
        for name, argv, env in procs:
            spawn(name, argv, env, fresh=not append)
        try:
            _watch(started, deadline_s, grace_s=0.0 if restarting else FAILURE_GRACE_S, again=again)
        except LaunchError as err:
            why = str(err)
            raise
    finally:
        running = [(name, proc, log) for name, proc, log in started if proc.poll() is None]
        for name, proc, log in running:  # a process held somewhere writes where, to its log, before it is killed
            with open(log, "a") as f:
                f.write(f"\npsar: {name} stopped by the launcher because {why}"
                        + (" to restart\n" if restarting else "; its threads' stacks follow\n"))
            if not restarting:
                proc.send_signal(signal.SIGUSR1)
        if running and not restarting:
            time.sleep(STACK_DUMP_S)
        for _, proc, _ in running:
            proc.kill()
            proc.wait()
        for thread in echoes:
            thread.join(5)


def _start(zygote: Zygote | None, argv: list[str], env: dict[str, str], log, echo: bool,
           stderr_tty: bool) -> subprocess.Popen | Forked:
    """Start argv with its output in log (stdout through a pipe when echoed; stderr on this
    terminal when stderr_tty), forked from the zygote when there is one."""
    if zygote is None:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if echo else log,
                                stderr=None if stderr_tty else log)
    read = None
    stdout = log.fileno()
    if echo:
        read, stdout = os.pipe()
    try:
        proc = Forked(zygote, zygote.fork(argv, env, stdout, 2 if stderr_tty else log.fileno()))
    except BaseException:
        if read is not None:
            os.close(read)
        raise
    finally:
        if echo:
            os.close(stdout)  # the child holds it now: end of file when it exits
    if read is not None:
        proc.stdout = os.fdopen(read, "rb")
    return proc


def _tee(stream, log_path: Path) -> None:
    """Copy a process's stdout, line by line, to its log and to this terminal."""
    with stream, open(log_path, "a") as log:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            log.write(line)
            log.flush()
            sys.stdout.write(line)
            sys.stdout.flush()


def _watch(procs, deadline_s: float | None, grace_s: float = FAILURE_GRACE_S, again=None) -> None:
    """Wait until every process of procs (a list that again() may change) exits 0. A failed
    process is started anew where again(name, failure, failed_at) gives one in its place;
    otherwise its failure fails the job (LaunchError), once the others had grace_s to end."""
    start = time.monotonic()
    failed_at = None
    failure = None
    while True:
        codes = [(name, proc.poll(), log) for name, proc, log in procs]
        if all(code == 0 for _, code, _ in codes):
            return
        bad = [(name, code, log) for name, code, log in codes if code not in (None, 0)]
        if bad and failure is None:
            name, code, log = bad[0]
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() \
                else f"exited with code {code}"
            text = f"{name} {how}: {_tail(log) or 'no last words'} (log: {log})"
            if again is not None and again(name, text, time.time()) is not None:
                continue
            failure = text
            failed_at, failed_wall = time.monotonic(), time.time()
        if failure and (all(code is not None for _, code, _ in codes)
                        or time.monotonic() - failed_at > grace_s):
            raise LaunchError(failure, failed_wall)
        if deadline_s is not None and time.monotonic() - start > deadline_s:
            running = [name for name, code, _ in codes if code is None]
            raise LaunchError(f"run exceeded its {deadline_s:.0f} s deadline; {', '.join(running)} "
                              "were still running and have been killed")
        time.sleep(0.05)
