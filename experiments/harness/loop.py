"""The named experiments' training loop: a script written on the job object a user's own
script gets (experiments/harness/job.py), so both write the same run directory the same way.

    module = job.attach(model, optim.build)
    for each step:
        for each shard this process trains on:   # one, or all of them for `local`
            job.backward(loss(module(x), y))
        job.step()
    job.close(evaluate)
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments.settings import config as config_mod
from experiments.settings.config import RunConfig
from experiments.workloads.datasets import BatchFeeder
from experiments.harness.distenv import DistEnv
from experiments.harness.job import Job
from experiments.workloads.tasks import get_task


def train(cfg: RunConfig, env: DistEnv, run_dir: Path, resume: bool = False) -> dict | None:
    """Run `cfg` as worker `env.rank`; rank 0 also writes model.pt and summary.json (returned).

    resume: continue from this rank's checkpoint in run_dir (model, optimizer, step).
    """
    job = Job(cfg, env, run_dir, resume, steps=cfg.steps)
    dtype = cfg.torch_dtype
    dataset = cfg.data.build(cfg.seed)
    task = get_task(dataset.task)
    torch.manual_seed(cfg.seed)  # every rank builds the identical initial model
    model = cfg.model.build().to(device=job.device, dtype=dtype)
    module = job.attach(model, cfg.optim.build)
    first = job.start_step  # the checkpoint's step, or the shards' for a worker that rejoined them
    torch.manual_seed(cfg.seed + 1 + env.rank + first)  # runtime randomness (dropout) differs by rank
    feeders = [BatchFeeder(dataset, shard, cfg.workers, cfg.batch_size, cfg.seed, dtype, job.device)
               for shard in job.shards]
    # Engines that move embedding rows may fetch the next batch's rows early, where the model
    # says which rows a batch reads.
    row_ids = getattr(model, "row_ids", None) if len(feeders) == 1 else None
    for step in job.steps(cfg.steps):  # under backup workers a late worker skips to the shards' step
        for feeder in feeders:
            inputs, targets = feeder.batch(step)
            job.backward(task.loss(module(*inputs), targets))
        if row_ids is not None and step + 1 < cfg.steps:  # the next batch's rows, while this step ends
            job.prefetch(row_ids(*feeders[0].batch(step + 1)[0]))
        job.step(samples=cfg.batch_size * len(feeders))
    return job.close(lambda m: task.evaluate(m, dataset, cfg.eval_batch_size, dtype, job.device))


def prepare_run_dir(cfg: RunConfig, run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    config_mod.save(cfg, run_dir / "config.json")
    return run_dir
