"""The training loop, written once for every engine.

    module = engine.attach(model, optim.build)
    for each step:
        for each shard this process trains on:   # one, or all of them for `local`
            engine.backward(loss(module(x), y))
        engine.step()
    engine.close()
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from . import config as config_mod
from . import files
from .config import RunConfig
from .agreement import check_rendezvous_peers
from .board import RankBoard
from .overrides import to_dict
from .checkpoint import WorkerCheckpoints
from .data import BatchFeeder
from .distenv import DistEnv
from .engines import get_engine
from .metrics import MetricsWriter, param_sha256, step_record, summarize, summary_config, write_json
from .progress import Progress
from .tasks import get_task
from .trace import Tracer
from .trace import merge as merge_trace


def pick_device(cfg: RunConfig, env: DistEnv) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def set_threads(cfg: RunConfig, env: DistEnv) -> None:
    # Workers on one host share its cores; oversubscribing them slows every engine alike.
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, env.local_world))
    torch.set_num_threads(threads)


def train(cfg: RunConfig, env: DistEnv, run_dir: Path, resume: bool = False) -> dict | None:
    """Run `cfg` as worker `env.rank`; rank 0 also writes model.pt and summary.json.

    resume: continue from this rank's checkpoint in run_dir (model, optimizer, step).
    """
    run_dir = Path(run_dir)
    set_threads(cfg, env)
    device = pick_device(cfg, env)
    dtype = cfg.torch_dtype
    dataset = cfg.data.build(cfg.seed)
    task = get_task(dataset.task)
    torch.manual_seed(cfg.seed)  # every rank builds the identical initial model
    model = cfg.model.build().to(device=device, dtype=dtype)
    checkpoints = WorkerCheckpoints(run_dir, env.rank, cfg.checkpoint.every, resume)
    checkpoints.restore_model(model)
    first = checkpoints.start_step
    torch.manual_seed(cfg.seed + 1 + env.rank + first)  # runtime randomness (dropout) differs by rank

    tracer = Tracer(run_dir, f"rank {env.rank}", cfg.trace)
    engine = get_engine(cfg.engine).make(cfg, env, device, tracer.record if cfg.trace else None)
    check_rendezvous_peers(cfg, env.rank)  # the parameter-server shards check at join instead
    module = engine.attach(model, checkpoints.optimizer_factory(cfg.optim.build))
    feeders = [BatchFeeder(dataset, shard, cfg.workers, cfg.batch_size, cfg.seed, dtype, device)
               for shard in engine.shards]
    writer = MetricsWriter(run_dir, env.rank, keep_before=first)
    board = RankBoard(run_dir, to_dict(cfg), env.rank) if cfg.tensorboard else None
    progress = Progress(cfg.steps, env.rank == 0, label=f"{cfg.experiment}/{cfg.engine}")

    # Engines that move embedding rows may fetch the next batch's rows early, where the model
    # says which rows a batch reads.
    prefetch = getattr(engine, "prefetch", None) if hasattr(model, "row_ids") and len(feeders) == 1 else None
    start = time.perf_counter()
    last_compute = 0.0
    for step in range(first, cfg.steps):
        t0 = time.perf_counter()
        # A straggler stalls before computing, so its gradients leave late (and stale).
        cfg.fault.stall(env.rank, last_compute)
        computing = time.perf_counter()
        losses = []
        for feeder in feeders:
            inputs, targets = feeder.batch(step)
            with tracer.span("forward", step=step):
                loss = task.loss(module(*inputs), targets)
            with tracer.span("backward", step=step):
                engine.backward(loss)
            losses.append(loss.detach())
        if prefetch is not None and step + 1 < cfg.steps:  # the next batch's rows, while this step ends
            prefetch(model.row_ids(*feeders[0].batch(step + 1)[0]))
        t1 = time.perf_counter()
        last_compute = t1 - computing  # without the stall, or stalls would compound
        with tracer.span("step", step=step):
            stats = engine.step()
        t2 = time.perf_counter()
        loss_value = torch.stack(losses).mean().item()
        record = step_record(step, start, t0, t1, t2, loss_value, cfg.batch_size * len(feeders), stats)
        writer.write(record)
        if board is not None:
            board.step(record)
        progress.update(step + 1, loss_value)
        checkpoints.after_step(step + 1, model)
    wall_s = time.perf_counter() - start
    writer.close()
    engine.close()
    tracer.save()

    if env.rank != 0:
        if board is not None:
            board.close()
        return None
    model_cpu = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    files.save_torch(model_cpu, run_dir / "model.pt")
    eval_metrics = task.evaluate(model, dataset, cfg.eval_batch_size, dtype, device)
    summary = summarize(run_dir, summary_config(cfg), eval_metrics, wall_s, param_sha256(model),
                        first_step=first)
    summary.update(engine.report())
    write_json(run_dir / "summary.json", summary)
    if board is not None:
        board.close(summary, to_dict(cfg))
    if cfg.trace:
        merge_trace(run_dir)  # what this host sees; `psar run` merges again once servers are done
    return summary


def prepare_run_dir(cfg: RunConfig, run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    config_mod.save(cfg, run_dir / "config.json")
    return run_dir

