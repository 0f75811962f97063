"""Run a function on N real processes joined by a Gloo process group, with a deadline."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from datetime import timedelta

from experiments.runtime.sites import free_port


def _entry(fn, rank, world, port, args, queue, group):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if group:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        result = fn(rank, world, *args)
        if group:
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout_s: float = 60.0, group: bool = True) -> list:
    """Call fn(rank, world, *args) on `world` spawned processes; return results by rank.

    group=False: no process group around fn, which makes its own (MASTER_ADDR and a free
    MASTER_PORT are set).

    fn must be importable (a module-level function) and return plain Python data (no tensors). A rank that fails or a run that passes
    the deadline raises AssertionError with the rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, group)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            try:
                rank, status, value = queue.get(timeout=timeout_s)
            except Exception:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(results))} did not "
                                     f"finish within {timeout_s} s") from None
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
