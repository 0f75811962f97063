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
The run directory is what named experiments write (metrics/rank<r>.jsonl, summary.json,
model.pt), so `psar plot`, `psar table` and `psar model` read it unchanged.

Under the parameter-server engines the optimizer runs on the shards: make_optimizer is
called once, on worker 0, to learn which optimizer and settings to run there (SGD, Adam,
AdamW or Adagrad, one parameter group).

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

import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import config as config_mod
from . import files
from .agreement import check_rendezvous_peers
from .config import RunConfig
from .distenv import DistEnv
from .engines import get_engine
from .launcher import RUN_DIR_ENV
from .metrics import MetricsWriter, param_sha256, step_record, summarize, summary_config
from .script import script_config
from .trace import Tracer
from .trace import merge as merge_trace
from .train import pick_device, set_threads
from .worker import SERVERS_FILE

__all__ = ["Job", "init", "script_config"]

SERVERS_ENV = "PSAR_SERVERS"
"""Comma-separated shard addresses, for ps-* runs started without `psar launch`."""
ENGINE_ENV = "PSAR_ENGINE"
"""The engine init() uses when not given one, for runs started without `psar launch`."""


def init(engine: str | None = None, out: str | Path | None = None, overrides: Sequence[str] = (),
         servers: Sequence[str] | None = None, device: str | None = None) -> "Job":
    """Join the job this process was started in and return it.

    Under `psar launch` everything comes from the run directory it names. Under torchrun or
    Slurm: engine (default: $PSAR_ENGINE, else "allreduce"), out (the run directory; default runs/<script name>),
    overrides (`--set` assignments such as "allreduce.algorithm=ring"), servers (the shards'
    addresses for ps-*; default: $PSAR_SERVERS) and device ("cpu" or "cuda").
    """
    env = DistEnv.from_environ()
    _export_rendezvous(env)
    run_dir = os.environ.get(RUN_DIR_ENV)
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
    return Job(cfg, DistEnv(env.rank, env.world, env.local_rank, env.local_world, tuple(servers), env.master),
               run_dir)


def _export_rendezvous(env: DistEnv) -> None:
    """torch.distributed's env:// reads these; under Slurm they come from its own variables."""
    os.environ.setdefault("RANK", str(env.rank))
    os.environ.setdefault("WORLD_SIZE", str(env.world))
    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    if env.master:
        addr, _, port = env.master.rpartition(":")
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", port)


class Job:
    """One worker of a distributed run of a user's script. Make it with init()."""

    def __init__(self, cfg: RunConfig, env: DistEnv, run_dir: Path) -> None:
        spec = get_engine(cfg.engine)
        if not spec.processes_per_worker:
            raise ValueError(f"engine {cfg.engine!r} runs every worker in one process; a script runs one "
                             "worker per process: use ddp, allreduce, ps-sync, ps-async or ps-ssp")
        if spec.uses_servers and not env.servers:
            raise ValueError(f"engine {cfg.engine} needs the server shards' addresses: start the script with "
                             f"psar launch, or set {SERVERS_ENV}=tcp://HOST:PORT,... (see psar server)")
        self.config, self.run_dir = cfg, Path(run_dir)
        self.rank, self.world_size, self.local_rank = env.rank, env.world, env.local_rank
        set_threads(cfg, env)
        self.device = pick_device(cfg, env)
        self._tracer = Tracer(self.run_dir, f"rank {env.rank}", cfg.trace)
        self._engine = spec.make(cfg, env, self.device, self._tracer.record if cfg.trace else None)
        self._state = "created"
        self._model: torch.nn.Module | None = None
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._step = 0

    @property
    def engine(self) -> str:
        return self.config.engine

    def attach(self, model: torch.nn.Module,
               make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> torch.nn.Module:
        """Agree on the initial parameters (rank 0's), install the engine's hooks and build the
        optimizer; return the module to call forward on. Once, before any backward."""
        self._need("created", "attach")
        check_rendezvous_peers(self.config, self.rank)
        self._model = model
        module = self._engine.attach(model, make_optimizer)
        if get_engine(self.config.engine).uses_servers:  # the shards step; the script schedules this one
            self._engine.schedule = make_optimizer([p for p in model.parameters() if p.requires_grad])
            self._engine.allow_clip()
        module.register_forward_pre_hook(self._count_samples)
        self._writer = MetricsWriter(self.run_dir, self.rank)
        self._state = "attached"
        self._start = self._mark = time.perf_counter()
        return module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer to hand a torch.optim.lr_scheduler: the engine's own on allreduce and
        ddp; under the parameter servers one make_optimizer built here, never stepped, whose
        learning rate each step's pushes carry to the shards."""
        if self._state == "created":
            raise RuntimeError("job.optimizer before attach(model, make_optimizer): there is none yet")
        return getattr(self._engine, "schedule", None) or self._engine.optimizer

    def no_sync(self):
        """A context in which forward and backward only accumulate gradients, as DDP's
        no_sync: the next job.backward outside it communicates their sum (every engine)."""
        self._need("attached", "no_sync")
        return self._engine.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient by its global norm, between backward and step, as
        torch.nn.utils.clip_grad_norm_ does under DDP; returns the norm before clipping. Under
        ps-sync the shards hold each step's update, give the sums of squares of their parts
        and update with the coefficient every worker sends (call it from the first step on);
        ps-async and ps-ssp have no averaged gradient and refuse it."""
        self._need("attached", "clip_grad_norm_")
        if get_engine(self.config.engine).uses_servers:
            return self._engine.clip_grad_norm_(max_norm, norm_type)
        params = [p for p in self._model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def _count_samples(self, _module, args) -> None:
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self._samples += first.shape[0] if first is not None and first.dim() else 0

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the engine's communication started inside it."""
        self._need("attached", "backward")
        self._engine.backward(loss)
        self._losses.append(loss.detach())

    def step(self) -> dict:
        """Finish this step's communication and update the parameters (the optimizer runs here
        or on the shards); record the step. Returns its metrics."""
        self._need("attached", "step")
        if not self._losses:
            raise RuntimeError("step() before backward(loss): there is no gradient to apply")
        computed = time.perf_counter()
        stats = self._engine.step()
        done = time.perf_counter()
        record = step_record(self._step, self._start, self._mark, computed, done,
                             torch.stack(self._losses).float().mean().item(), self._samples, stats)
        self._writer.write(record)
        self._losses, self._samples, self._mark = [], 0, done
        self._step += 1
        return record

    def close(self) -> dict | None:
        """Leave the job once every worker is done; rank 0 then holds the final parameters and
        writes model.pt and summary.json (returned)."""
        self._need("attached", "close")
        self._state = "closed"
        wall_s = time.perf_counter() - self._start
        self._writer.close()
        self._engine.close()
        self._tracer.save()
        if self.rank != 0:
            return None
        model = self._model
        files.save_torch({k: v.detach().cpu() for k, v in model.state_dict().items()}, self.run_dir / "model.pt")
        cfg = self.config
        summary = summarize(self.run_dir, summary_config(cfg), {}, wall_s, param_sha256(model))
        summary.update(self._engine.report())
        files.write_json(self.run_dir / "summary.json", summary)
        if cfg.trace:
            merge_trace(self.run_dir)  # what this host sees; `psar launch` merges again with the shards'
        return summary

    def _need(self, state: str, call: str) -> None:
        if self._state == state:
            return
        order = {"created": "call attach(model, make_optimizer) first",
                 "attached": "attach() was already called; it is called once",
                 "closed": "the job is closed"}
        raise RuntimeError(f"{call}() now: {order[self._state]}")
