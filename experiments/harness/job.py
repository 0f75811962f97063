"""One worker's run, from start to summary: the object a user's script gets from
`experiments.api.init()`, and the one the named experiments' loop (experiments/harness/loop.py) is
written on, so that both write the same run directory the same way.

    job = Job(cfg, env, run_dir)              # threads, device, engine, checkpoints
    module = job.attach(model, make_opt)      # agree on parameters (or restore them), hooks
    for step in job.steps(total):             # from 0, or the checkpoint's step under --resume
        job.backward(loss(module(x), y))      # per micro-batch; communication inside
        job.step()                            # update; metrics, TensorBoard, progress, checkpoint
    job.close(evaluate)                       # rank 0: model.pt, eval, summary.json, trace

The forward hooks attach() installs count the samples, time the forward for the trace, and
stall a straggler (fault.slow_rank), stop or kill a worker (fault.pause_*, fault.kill_*)
before its step's first forward, so a script gets the injected faults too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from ps.allocator import keep_freed_pages
from experiments.rundir import files
from experiments.settings.agreement import check_rendezvous_peers
from experiments.rundir.tensorboard_log import RankBoard
from experiments.rundir.checkpoint import WorkerCheckpoints
from experiments.rundir.starts import record_start
from experiments.settings.config import RunConfig
from experiments.harness.distenv import DistEnv
from experiments.engines import get_engine
from experiments.rundir.memory import MemoryPeaks
from experiments.rundir.metrics import MetricsWriter, param_sha256, step_record, summarize, summary_config
from experiments.settings.overrides import to_dict
from experiments.rundir.progress import Progress
from experiments.rundir.trace import Tracer
from experiments.rundir.trace import merge as merge_trace
from experiments.harness.devices import pick_device, set_threads
from experiments.harness.inject import Faults

MakeOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class Job:
    """One worker of a run. Args:
        cfg, env: the run's config and this process's place in it.
        run_dir: where the run's files go.
        resume: start from this rank's checkpoint in run_dir (model, optimizer, step).
        steps: the steps the loop will run, for the progress bar (None: a script's, unknown).
    """

    def __init__(self, cfg: RunConfig, env: DistEnv, run_dir: Path, resume: bool = False,
                 steps: int | None = None) -> None:
        keep_freed_pages()  # every engine's workers alike, before any thread allocates (ps/allocator.py)
        # The first optimizer imports it (1 s of CPU in a fresh interpreter, forks from the
        # zygote have it): here it counts as the process's start, not as its rendezvous.
        import torch._dynamo  # noqa: F401
        began = time.time()
        spec = get_engine(cfg.engine)
        self.config, self.run_dir = cfg, Path(run_dir)
        self.rank, self.world_size, self.local_rank = env.rank, env.world, env.local_rank
        self._restarts = env.restarts
        self._faults = Faults(cfg.fault, env.rank, env.restarts, self.run_dir)
        set_threads(cfg, env)
        self.device = pick_device(cfg, env)
        self._checkpoints = WorkerCheckpoints(self.run_dir, env.rank, cfg.checkpoint.every, resume)
        self._tracer = Tracer(self.run_dir, f"rank {env.rank}", cfg.trace)
        loaded = time.time()
        self._engine = spec.make(cfg, env, self.device, self._tracer.record if cfg.trace else None)
        # this start's phases, for a restarted job's recovery time (experiments/rundir/starts.py)
        self._began, self._phases = began, {"checkpoint_s": loaded - began, "rendezvous_s": time.time() - loaded}
        self._uses_servers = spec.uses_servers
        self._progress = Progress(steps, env.rank == 0, label=f"{cfg.experiment}/{cfg.engine}")
        self._state = "created"
        self._model: torch.nn.Module | None = None
        self._losses: list[torch.Tensor] = []
        self._samples = 0
        self._first = self._checkpoints.start_step
        self._step = self._first
        self._forward_at: float | None = None  # time.time() of the forward under way, for the trace
        self._computing: float | None = None  # after this step's stall: its compute starts
        self._last_compute = 0.0

    @property
    def engine(self) -> str:
        return self.config.engine

    @property
    def start_step(self) -> int:
        """The first step to run: 0, or the step the checkpoint was taken after (--resume);
        after attach, for a worker started again to rejoin running shards, their step."""
        return self._first

    @property
    def shards(self) -> list[int]:
        """The data shards this process trains on each step: [rank], or every one (local)."""
        return list(self._engine.shards)

    @property
    def next_step(self) -> int:
        """The step the job runs next: one more than the last, or, under ps-sync with backup
        workers, the shards' step when this worker's push came late (the steps between ran
        without it)."""
        return self._step

    def steps(self, total: int):
        """The steps to run, from start_step while below total: `for step in job.steps(N)`,
        each ending with job.step(); it skips what next_step skips."""
        while self._step < total:
            at = self._step
            yield at
            if self._step == at:
                raise RuntimeError(f"step {at} of job.steps() ended without job.step()")

    def attach(self, model: torch.nn.Module, make_optimizer: MakeOptimizer) -> torch.nn.Module:
        """Agree on the initial parameters (rank 0's, or the checkpoint's), install the engine's
        hooks and build the optimizer; return the module to call forward on, whose state_dict
        has the model's own keys under every engine. Once, before any backward."""
        self._need("created", "attach")
        start = time.time()
        check_rendezvous_peers(self.config, self.rank)
        restore = time.time()
        if self._checkpoints.restore_model(model) and hasattr(self._engine, "keep_restored"):
            self._engine.keep_restored(self._checkpoints.start_step)  # gossip: each worker from its own model
        restore_s = time.time() - restore
        self._model = model
        module = self._engine.attach(model, self._checkpoints.optimizer_factory(make_optimizer))
        self._checkpoints.restore_optimizer()
        self._phases["checkpoint_s"] += restore_s
        self._phases["rendezvous_s"] += time.time() - start - restore_s
        record_start(self.run_dir, self.rank, self._restarts, self._began, **self._phases)
        if self._uses_servers:  # the shards step; the script schedules this one
            self._engine.use_schedule(make_optimizer([p for p in model.parameters() if p.requires_grad]))
            self._engine.allow_clip()
        module.register_forward_pre_hook(self._before_forward)
        module.register_forward_hook(self._after_forward)
        # a worker that rejoined running shards goes on at their step: its earlier records stay
        self._first = self._step = max(self._step, getattr(self._engine, "next_step", self._step))
        self._writer = MetricsWriter(self.run_dir, self.rank, keep_before=self._step)
        self._memory = MemoryPeaks(self._engine)
        self._board = RankBoard(self.run_dir, to_dict(self.config), self.rank) if self.config.tensorboard else None
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
        own = getattr(self._engine, "clip_grad_norm_", None)  # the shards', or zero's sharded gradient
        if own is not None:
            return own(max_norm, norm_type)
        params = [p for p in self._model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def prefetch(self, row_ids) -> None:
        """Where the engine can (the parameter servers), start fetching the embedding rows the
        next batch reads ({table: ids}) while this step ends; otherwise nothing."""
        prefetch = getattr(self._engine, "prefetch", None)
        if prefetch is not None:
            prefetch(row_ids)

    def _before_forward(self, _module, args) -> None:
        if self._computing is None:  # the step's first forward: faults strike here, a straggler stalls
            self._faults.before_step(self._step, self._last_compute)
            self._computing = time.perf_counter()
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self._samples += first.shape[0] if first is not None and first.dim() else 0
        self._forward_at = time.time()

    def _after_forward(self, _module, _args, _output) -> None:
        if self._forward_at is not None:
            self._tracer.record("forward", self._forward_at, time.time(), step=self._step)
            self._forward_at = None

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the engine's communication started inside it."""
        self._need("attached", "backward")
        with self._tracer.span("backward", step=self._step):
            self._engine.backward(loss)
        self._losses.append(loss.detach())

    def step(self, samples: int | None = None) -> dict:
        """Finish this step's communication and update the parameters (the optimizer runs here
        or on the shards); record the step (metrics, TensorBoard, progress) and checkpoint it
        every checkpoint.every steps. samples: the step's examples (default: the first tensor
        argument's length, summed over this step's forwards). Returns its metrics."""
        self._need("attached", "step")
        if not self._losses:
            raise RuntimeError("step() before backward(loss): there is no gradient to apply")
        computed = time.perf_counter()
        self._memory.before_step(self._model)
        with self._tracer.span("step", step=self._step):
            stats = self._engine.step()
        done = time.perf_counter()
        self._memory.after_step(self._model)
        memory = self._memory.changed()
        if memory is not None:  # each rank's peaks, in the record of the step they grew
            stats = {**stats, "memory": memory}
        loss = torch.stack([l.double() for l in self._losses]).mean().item()
        record = step_record(self._step, self._start, self._mark, computed, done, loss,
                             self._samples if samples is None else samples, stats)
        self._writer.write(record)
        if self._board is not None:
            self._board.step(record)
        # ps-sync with backup workers: a worker whose push came late goes on at the shards' step
        self._step = max(self._step + 1, getattr(self._engine, "next_step", 0))
        self._progress.update(self._step, loss)
        self._checkpoints.after_step(self._step, self._model)
        self._last_compute = computed - (self._computing if self._computing is not None else self._mark)
        self._losses, self._samples, self._computing = [], 0, None
        self._mark = time.perf_counter()
        return record

    def close(self, evaluate: Callable[[torch.nn.Module], dict] | None = None) -> dict | None:
        """Leave the job once every worker is done; rank 0 then holds the final parameters,
        writes model.pt, runs evaluate(model) (its dict is the summary's "eval") and writes
        summary.json, which it returns."""
        self._need("attached", "close")
        self._state = "closed"
        wall_s = time.perf_counter() - self._start
        self._writer.close()
        self._engine.close()
        self._tracer.save()
        if self.rank != 0:
            if self._board is not None:
                self._board.close()
            return None
        model, cfg = self._model, self.config
        files.save_torch({k: v.detach().cpu() for k, v in model.state_dict().items()}, self.run_dir / "model.pt")
        eval_metrics = evaluate(model) if evaluate is not None else {}
        report = self._engine.report()
        summary = summarize(self.run_dir, summary_config(cfg), eval_metrics, wall_s, param_sha256(model),
                            first_step=self.start_step, dropped=report.get("dropped_pushes"))
        summary.update(report)
        files.write_json(self.run_dir / "summary.json", summary)
        if self._board is not None:
            self._board.close(summary, to_dict(cfg))
        if cfg.trace:
            merge_trace(self.run_dir)  # what this host sees; the launcher merges again with the shards'
        return summary

    def _need(self, state: str, call: str) -> None:
        if self._state == state:
            return
        order = {"created": "call attach(model, make_optimizer) first",
                 "attached": "attach() was already called; it is called once",
                 "closed": "the job is closed"}
        raise RuntimeError(f"{call}() now: {order[self._state]}")
