"""Run a function on N real processes joined by a Gloo process group, with a deadline.

The processes of each world size are started once and kept for the session: starting one
imports torch (seconds of CPU on 2 cores), which cost more than most of the functions run
on them. A call that fails or passes its deadline ends its world's processes, so the next
call starts from fresh ones."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queues
import time
import traceback
from datetime import timedelta

from experiments.runtime.sites import free_port


def _entry(fn, rank, world, port, args, queue):
    """A fresh rank, without a process group: fn makes its own."""
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _serve(rank, world, port, inbox, outbox):
    """A kept rank: in one Gloo group, run each (fn, args) that arrives, until it is killed
    (_Kept.end) or the process that started it is gone (killed, say: nothing else would end
    this one)."""
    import torch
    import torch.distributed as dist

    parent = os.getppid()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        try:
            job = inbox.get(timeout=1.0)
        except queues.Empty:
            if os.getppid() != parent:
                os._exit(1)
            continue
        call, fn, args = job
        try:
            outbox.put((rank, "ok", fn(rank, world, *args), call))
            dist.barrier()  # every rank is done with this call before any starts the next
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc(), call))


class _Kept:
    """`world` ranks of one Gloo group, started once, sent one function at a time."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.outbox, self.calls = world, ctx.Queue(), 0
        self.inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def call(self, fn, args, timeout_s: float) -> list:
        self.calls += 1
        for inbox in self.inboxes:
            inbox.put((self.calls, fn, args))
        return _collect(self.outbox, self.world, timeout_s, self.calls)

    def end(self) -> None:
        for p in self.procs:
            p.kill()
            p.join(timeout=5)


_kept: dict[int, _Kept] = {}


def _collect(queue, world: int, timeout_s: float, call: int | None = None) -> list:
    """Each rank's result from queue, by rank; AssertionError on a failure or the deadline.
    call: only the answers to that call count (a kept rank's late word on an earlier one
    does not)."""
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world:
        try:
            rank, status, value, *of = queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:
            raise AssertionError(f"ranks {sorted(set(range(world)) - set(results))} did not "
                                 f"finish within {timeout_s} s") from None
        if call is not None and of and of[0] != call:  # an earlier call's (none: its start's)
            continue
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        results[rank] = value
    return [results[r] for r in range(world)]


def run_ranks(fn, world: int, *args, timeout_s: float = 60.0, group: bool = True) -> list:
    """Call fn(rank, world, *args) on `world` processes; return results by rank.

    With group=True (the default) they are the session's kept processes of that world size,
    in one Gloo group. group=False: fresh processes, with no process group around fn, which
    makes its own (MASTER_ADDR and a free MASTER_PORT are set).

    fn must be importable (a module-level function) and return plain Python data (no tensors). A rank that fails or a run that passes
    the deadline raises AssertionError with the rank's traceback.
    """
    if group:
        pickle.dumps((fn, args))  # what cannot travel fails here, not as a missed deadline
        try:
            if world not in _kept:
                _kept[world] = _Kept(world)
            return _kept[world].call(fn, args, timeout_s)
        except BaseException:  # its ranks may be stuck in a collective: the next call starts anew
            if world in _kept:
                _kept.pop(world).end()
            raise
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(queue, world, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
