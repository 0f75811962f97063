"""A benchmark peer: the parameter server of PyTorch's own RPC examples (the batch-update
pattern of torch.distributed.rpc with @rpc.functions.async_execution), training one of
psar's experiments, so that `psar bench` can set ps-sync against it in one run.

    python -m experiments.bench.rpc_baseline EXPERIMENT STEPS OUT.json    # as ranks 0..N of a launcher

Rank 0 is the server: it holds the model and the optimizer; each of the N workers computes
a gradient on its shard, sends it with update_and_fetch, and gets the new parameters once
all N have sent theirs (one averaged optimizer step, as ps-sync). This is a baseline to
measure against, for loopback only: RPC pickles its arguments.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed.rpc as rpc

from ps.allocator import keep_freed_pages

SKIP_STEPS = 3
"""Steps left out of the throughput (connections and caches warming up), as in psar bench."""


def _experiment(name: str, workers: int, steps: int):
    from experiments.settings.presets import build_config

    return build_config(name, ("threads=1",), engine="ps-sync", workers=workers, steps=steps)


class BatchUpdateServer:
    """Sums the gradients of one step from every worker, then steps the optimizer once and
    answers every worker's pending call with the new parameters."""

    def __init__(self, cfg) -> None:
        torch.manual_seed(cfg.seed)
        self.model = cfg.model.build().to(dtype=cfg.torch_dtype)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = cfg.optim.build(self.params)
        self.workers, self.pending = cfg.workers, 0
        self.lock = threading.Lock()
        self.future = torch.futures.Future()
        for p in self.params:
            p.grad = torch.zeros_like(p)

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch(server_rref, grads: list[torch.Tensor]) -> torch.futures.Future:
        self = server_rref.local_value()
        with self.lock:
            for p, g in zip(self.params, grads):
                p.grad += g
            self.pending += 1
            future = self.future
            if self.pending == self.workers:
                for p in self.params:
                    p.grad /= self.workers
                self.optimizer.step()
                for p in self.params:
                    p.grad.zero_()
                future.set_result(self.parameters())
                self.pending, self.future = 0, torch.futures.Future()
        return future


def train_worker(server_rref, experiment: str, workers: int, steps: int, shard: int) -> list[float]:
    """One worker's loop; returns the wall time at which each step ended."""
    from experiments.workloads.datasets import BatchFeeder
    from experiments.workloads.tasks import get_task

    torch.set_num_threads(1)
    cfg = _experiment(experiment, workers, steps)
    dataset = cfg.data.build(cfg.seed)
    task = get_task(dataset.task)
    torch.manual_seed(cfg.seed)
    model = cfg.model.build().to(dtype=cfg.torch_dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    feeder = BatchFeeder(dataset, shard, workers, cfg.batch_size, cfg.seed, cfg.torch_dtype, torch.device("cpu"))
    ends = []
    for step in range(steps):
        inputs, targets = feeder.batch(step)
        for p in params:
            p.grad = None
        task.loss(model(*inputs), targets).backward()
        new = rpc.rpc_sync(server_rref.owner(), BatchUpdateServer.update_and_fetch,
                           args=(server_rref, [p.grad for p in params]))
        with torch.no_grad():
            for p, value in zip(params, new):
                p.copy_(value)
        ends.append(time.time())
    return ends


def samples_per_sec(ends: list[list[float]], batch_size: int, skip: int = SKIP_STEPS) -> float:
    """All workers' samples per second over the steps after the first `skip`."""
    start, stop = max(e[skip - 1] for e in ends), min(e[-1] for e in ends)
    steps = sum(sum(1 for t in e[skip:] if t <= stop) for e in ends)
    return steps * batch_size / (stop - start)


def main(argv: list[str]) -> int:
    experiment, steps, out = argv[0], int(argv[1]), argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    workers = world - 1
    torch.set_num_threads(1)
    keep_freed_pages()  # as psar's own processes (ps/allocator.py)
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=120)
    if rank == 0:
        rpc.init_rpc("server", rank=0, world_size=world, rpc_backend_options=options)
        cfg = _experiment(experiment, workers, steps)
        server = rpc.RRef(BatchUpdateServer(cfg))
        futures = [rpc.rpc_async(f"worker{r}", train_worker, args=(server, experiment, workers, steps, r - 1))
                   for r in range(1, world)]
        ends = [f.wait() for f in futures]
        result = {"experiment": experiment, "workers": workers, "steps": steps,
                  "samples_per_sec": samples_per_sec(ends, cfg.batch_size)}
        with open(out, "w") as f:
            json.dump(result, f)
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    rpc.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
