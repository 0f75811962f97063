"""Your own training script on psar's engines, with a few changed lines.

    from experiments import api as psar

    job = psar.init()                      # rank, world size, engine and device from the launcher
    model = job.attach(Net().to(job.device), lambda params: torch.optim.SGD(params, lr=0.01))
    sampler = DistributedSampler(train_set, job.world_size, job.rank)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(train_set, batch_size=64, sampler=sampler):
            loss = F.cross_entropy(model(x.to(job.device)), y.to(job.device))
            job.backward(loss)             # in place of loss.backward()
            job.step()                     # in place of optimizer.step(); optimizer.zero_grad()
    job.close()

`psar launch --engine ps-sync --workers 2 train.py` starts the server shards and the workers
(torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and names the
run directory; so do `torchrun` (allreduce, ddp) and Slurm (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, the first host of SLURM_JOB_NODELIST), with the engine given to init().
The job is the one the named experiments' loop runs on (experiments/harness/job.py), so a script's
run directory is what theirs is (metrics/rank<r>.jsonl, summary.json, model.pt; trace.json
with --trace, TensorBoard files with --set tensorboard=true), and `psar plot`, `psar table`
and `psar model` read it unchanged. `job.close(evaluate)` puts evaluate(model)'s dict in
summary.json. With `--set checkpoint.every=K` every rank checkpoints every K steps, and
`psar launch --resume RUN_DIR train.py` goes on from the last: start the loop at
`job.start_step` (after attach; for a worker restarted into running shards, their step), or
write it `for step in job.steps(N):`, which also follows ps-sync's backup workers. The module attach() returns has the model's own state_dict keys under
every engine (DDP's would be "module.X").

After init() torch.distributed is initialised as after init_process_group under torchrun,
on every engine (under the parameter servers a Gloo group of the script's own, which never
carries the gradients): the script's own dist calls work, and it may destroy the group after
job.close().

Under the parameter-server engines the optimizer runs on the shards: make_optimizer is
called once, on worker 0, to learn which optimizer and settings to run there (SGD, Adam,
AdamW or Adagrad, one parameter group). A script's own checkpoint works on every engine: after
job.step(), model.state_dict() and job.optimizer.state_dict() are the state after that step
(under the parameter servers read from the shards, in torch's layout); load the model before
attach() and the optimizer with job.optimizer.load_state_dict() after it (which puts the state
back on the shards). Under zero every rank first calls job.optimizer.consolidate_state_dict(to=0),
as torch's ZeroRedundancyOptimizer asks. What the engine cannot take is refused by name.

As under DDP, every gradient is final when `job.backward(loss)` returns on allreduce and
ddp, so `job.clip_grad_norm_(max_norm)` (or torch's own clip on the model's parameters)
clips the averaged gradient there. `job.optimizer` takes any torch.optim.lr_scheduler on
every engine: under the parameter servers the learning rate it gives each step travels with
the pushes and the shards update with it. What the shards cannot see is refused by name at
`job.step()`: a gradient changed after backward pushed it (torch's own clip: use
`job.clip_grad_norm_`, for which the ps-sync shards agree on the norm), a schedule that
changes more than the learning rate.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Sequence

from experiments.settings import config as config_mod
from experiments.rundir import files
from experiments.settings.config import RunConfig
from experiments.harness.distenv import DistEnv
from experiments.engines import engines, get_engine
from experiments.harness.job import Job
from experiments.runtime.launcher import RESUME_ENV, RUN_DIR_ENV
from experiments.settings.script import script_config
from experiments.runtime.worker import SERVERS_FILE

__all__ = ["Job", "init", "script_config"]

SERVERS_ENV = "PSAR_SERVERS"
"""Comma-separated shard addresses, for ps-* runs started without `psar launch`."""
ENGINE_ENV = "PSAR_ENGINE"
"""The engine init() uses when not given one, for runs started without `psar launch`."""


def init(engine: str | None = None, out: str | Path | None = None, overrides: Sequence[str] = (),
         servers: Sequence[str] | None = None, device: str | None = None) -> "Job":
    """Join the job this process was started in and return it.

    Under `psar launch` everything comes from the run directory it names. Under torchrun or
    Slurm: engine (default: $PSAR_ENGINE, else RunConfig.engine), out (the run directory; default runs/<script name>),
    overrides (`--set` assignments such as "allreduce.algorithm=ring"), servers (the shards'
    addresses for ps-*; default: $PSAR_SERVERS) and device ("cpu" or "cuda").
    """
    env = DistEnv.from_environ()
    _export_rendezvous(env)
    run_dir = os.environ.get(RUN_DIR_ENV)
    resume = bool(run_dir) and os.environ.get(RESUME_ENV) == "1"
    if run_dir:
        if engine or out or overrides or servers is not None or device:
            raise ValueError(f"psar launch already chose the engine, settings and run directory ({run_dir}); "
                             "give them to psar launch, not to init()")
        run_dir = Path(run_dir)
        cfg = config_mod.load(run_dir / "config.json", timeout_s=30.0)
        servers = files.read_json(run_dir / SERVERS_FILE, what="server list") if get_engine(cfg.engine).uses_servers else ()
    else:
        script = sys.argv[0] or "script"
        servers = list(servers) if servers is not None else [a for a in os.environ.get(SERVERS_ENV, "").split(",") if a]
        cfg = script_config(script, sys.argv[1:], overrides, engine=engine or os.environ.get(ENGINE_ENV) or RunConfig.engine, workers=env.world,
                            servers=max(1, len(servers)), device=device)
        run_dir = Path(out or Path("runs") / Path(script).stem)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_mod.save(cfg, run_dir / "config.json")  # every rank writes the same, whole
    if cfg.workers != env.world:
        raise ValueError(f"the run is for {cfg.workers} workers but the launcher started {env.world}")
    spec = get_engine(cfg.engine)
    if not spec.processes_per_worker:
        usable = [name for name, other in engines().items() if other.processes_per_worker]
        raise ValueError(f"engine {cfg.engine!r} runs every worker in one process; a script runs one "
                         f"worker per process: use {', '.join(usable)}")
    if spec.uses_servers and not servers:
        raise ValueError(f"engine {cfg.engine} needs the server shards' addresses: start the script with "
                         f"psar launch, or set {SERVERS_ENV}=tcp://HOST:PORT,... (see psar server)")
    job = Job(cfg, dataclasses.replace(env, servers=tuple(servers)), run_dir, resume=resume)
    _process_group(job, cfg, env)
    return job


def _process_group(job: Job, cfg: RunConfig, env: DistEnv) -> None:
    """torch.distributed as a torchrun script has it after init_process_group: the engine's
    own group under allreduce and ddp; under the parameter servers one on Gloo that carries
    only the script's own calls (the gradients go to the shards). The script may destroy it
    after job.close(). A ps-* worker started again alone joins no group: the others' is theirs."""
    import torch

    from allreduce.group import script_group

    servers = get_engine(cfg.engine).uses_servers
    if servers and env.restarts:
        return
    device = torch.device("cpu") if servers else job.device
    script_group(device, env.rank, env.world, cfg.timeout_s)


def _export_rendezvous(env: DistEnv) -> None:
    """torch.distributed's env:// reads these; under Slurm they come from its own variables."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    if env.master:
        addr, _, port = env.master.rpartition(":")
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", port)
