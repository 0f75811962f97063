"""Entry point of one worker process: `python -m experiments.runtime.worker RUN_DIR [RUN_DIR ...]`.

Reads RUN_DIR/config.json and the launcher's RANK / WORLD_SIZE variables; several run
directories are trained one after another, their all-reduce groups meeting on one store at
MASTER_ADDR:MASTER_PORT (allreduce.group.SharedStore). A failure prints one line naming the
rank, the error and, in a batch, the run directory; the traceback goes to
RUN_DIR/logs/rank<r>.log.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import signal
import sys
import traceback
from pathlib import Path

from allreduce import group

from experiments.settings import config as config_mod
from experiments.rundir import files
from experiments.settings.config import RunConfig
from experiments.harness.distenv import DistEnv
from experiments.harness.loop import train

SERVERS_FILE = "servers.json"


def run_worker(run_dir: Path, env: DistEnv | None = None, resume: bool = False,
               cfg: RunConfig | None = None, batch: bool = False) -> int:
    """Train one worker of the run in run_dir; return the exit code.

    cfg: the resolved config (default: run_dir/config.json, which `psar run` wrote before
    starting this process). `psar worker` passes its own: the shared config.json is for
    the record and other readers, never read back by the process that wrote it.
    batch: one run of several in this process; a failure's line names run_dir.
    """
    run_dir = Path(run_dir)
    env = env or DistEnv.from_environ()
    try:
        addresses = run_dir / SERVERS_FILE
        if not env.servers and addresses.exists():  # written by `psar run` for its own servers
            env = dataclasses.replace(env, servers=tuple(files.read_json(addresses, what="server list")))
        cfg = cfg or config_mod.load(run_dir / "config.json")
        train(cfg, env, run_dir, resume)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # one clear line for the user; the traceback for the record
        logs = run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"rank{env.rank}.log", "a") as log:
            traceback.print_exc(file=log)
        where = f" in {run_dir}" if batch else ""
        print(f"psar: rank {env.rank} failed{where}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def main(argv: list[str]) -> int:
    # The launcher sends SIGUSR1 before it kills a process still running after another one
    # failed: where each thread stands goes to this process's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    if not argv:
        return "usage: python -m experiments.runtime.worker [--resume] RUN_DIR [RUN_DIR ...]"
    if len(argv) > 1:  # a batch of runs: their all-reduce groups meet on one store
        group.share_store(DistEnv.from_environ().master)
    for run_dir in argv:
        code = run_worker(Path(run_dir), resume=resume, batch=len(argv) > 1)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
