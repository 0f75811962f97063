"""Asynchronous decentralized SGD, gossip.mode=async: AD-PSGD (Lian et al., ICML 2018), on
the bipartite scheme that keeps it free of deadlock.

Even ranks are active and odd ranks passive; an active worker's partners are its neighbours
on the graph of the other parity (on a ring, both). Each worker keeps its model x_i; each
step it computes its gradient at a snapshot x^_i of it, taken when the previous step ended,
and then

- an active worker averages atomically with one partner, x_i, x_j <- (x_i + x_j) / 2 (its
  partners in turn, a fixed pairing schedule), and adds its update: x_i <- x_i + delta_i;
- a passive worker only adds its update, while a thread of its own serves the actives'
  averages whenever they come, one at a time, under a lock.

delta_i is the optimizer's step from x^_i on the gradient (plain SGD: -lr g), the update
AD-PSGD adds to a model that others may have averaged since it was read: no worker waits for
any but the partner it averages with, and none waits for a passive worker's compute. A step's
staleness is the number of changes to x_i between its snapshot and its update (ps-async's
measure: an active's own average makes it 1). Each step's record lists the changes to x_i in
their order (`gossip_ops`: averages served, with the active's rank and step), so that a run's
arithmetic can be replayed exactly (tests/process/test_gossip.py does, in float64); the
averages a passive served after its last step are in summary.json's `gossip_final_ops`.

The averages travel on a process group of their own (Gloo), from the actives' main thread and
the passives' serving thread; a passive receives from any active (Gloo's receive from any
source, which NCCL lacks: the mode runs on CPU).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from .gossip import GossipEngine
from .topology import neighbours
from .zero_buckets import nbytes

AVERAGE, DONE = 0, 1


class AsyncGossipEngine(GossipEngine):
    """Engine protocol of AD-PSGD; GossipEngine's set-up, consensus and close."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.device.type != "cpu":
            raise ValueError("gossip.mode=async receives each average from whichever active worker sends it "
                             "(Gloo's receive from any source), which NCCL lacks: run it with --device cpu")
        self.active = self.rank % 2 == 0
        # the graphs are undirected: a passive's actives are its neighbours of the other parity too
        self._partners = [j for j in neighbours(self.config.topology, self.rank, self.world) if j % 2 != self.rank % 2]
        self._actives = [] if self.active else self._partners
        if self.world < 2 or (self.active and not self._partners):
            raise ValueError(f"gossip.mode=async pairs even (active) with odd (passive) ranks on the graph: "
                             f"rank {self.rank} of {self.world} on gossip.topology={self.config.topology} has none")
        from datetime import timedelta

        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self._timeout_s))
        self._lock = threading.Lock()
        self._version = 0  # changes to x so far: averages served and updates
        self._ops: list[list] = []  # this step's changes to x, in order: [version, "average", rank, step]
        self._served_bytes = 0
        self._server: threading.Thread | None = None
        self._failed: BaseException | None = None

    # -- set-up --------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        out = super().attach(model, make_optimizer)
        self._x = self._flat.detach().clone()  # the model others average with; the parameters are x^
        self._before = torch.empty_like(self._x)  # x^, kept while the optimizer steps the parameters
        self._snapshot()
        if not self.active:
            self._server = threading.Thread(target=self._serve, name="psar-ad-psgd", daemon=True)
            self._server.start()
        return out

    def _start_exchange(self) -> None:
        """No exchange at step boundaries: the averages are the actives' own, mid-step."""
        self._works, self._sent, self._sent_at = [], 0, 0.0

    def _snapshot(self) -> None:
        """x^ <- x: the parameters the next gradient is computed at."""
        with self._lock, torch.no_grad():
            self._flat.copy_(self._x)
            self._read = self._version

    # -- the passive side ------------------------------------------------------------------------

    def _serve(self) -> None:
        """Average with each active that asks, until every partner active has said it is done."""
        header = torch.zeros(2, dtype=torch.int64)
        theirs = torch.empty_like(self._x)
        waiting = set(self._actives)
        try:
            while waiting:
                source = dist.recv(header, group=self._group)
                kind, step = int(header[0]), int(header[1])
                if kind == DONE:
                    waiting.discard(source)
                    continue
                dist.recv(theirs, src=source, group=self._group)
                with self._lock, torch.no_grad():  # step() reads and resets the count under it too
                    self._x.add_(theirs).div_(2)
                    reply = self._x.clone()
                    self._version += 1
                    self._ops.append([self._version, "average", source, step])
                    self._served_bytes += nbytes(reply)
                dist.send(reply, dst=source, group=self._group)
        except BaseException as err:  # raised in the main thread at the next step
            self._failed = err

    # -- step ------------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        if self._failed is not None:
            raise RuntimeError(f"gossip.mode=async: rank {self.rank}'s averages failed: {self._failed}")
        comm_s, sent, stats = 0.0, 0, {}
        if self.active:
            partner = self._partners[self._steps % len(self._partners)]
            began = time.perf_counter()
            if self.delay_s:  # an injected latency: the model's way there, as every byte of it would be late
                time.sleep(self.delay_s)
            with self._liveness.naming_lost_ranks():
                dist.send(torch.tensor([AVERAGE, self._steps], dtype=torch.int64), dst=partner, group=self._group)
                dist.send(self._x, dst=partner, group=self._group)
                dist.recv(self._x, src=partner, group=self._group)
            if self.delay_s:  # and the average's way back
                time.sleep(self.delay_s)
            comm_s, sent = time.perf_counter() - began, nbytes(self._x)
            self._version += 1
            stats["partner"] = partner
        self._before.copy_(self._flat.detach())
        self.optimizer.step()
        with self._lock, torch.no_grad():
            self._x.add_(self._flat.sub_(self._before))  # the parameters hold the update until the snapshot
            stats["staleness"] = self._version - self._read
            self._version += 1
            applied = self._version  # this update's number among the changes to x
            ops, self._ops = self._ops, []
            served, self._served_bytes = self._served_bytes, 0
        for p in self._params:
            p.grad = None
        stats.update({"comm_s": comm_s, "bytes_sent": sent + served, "bytes_recv": sent + served,
                      "gossip_read": self._read, "gossip_applied": applied})
        if ops:
            stats["gossip_ops"] = ops
        self._steps += 1
        self._snapshot()
        return stats

    # -- end -------------------------------------------------------------------------------------

    def close(self) -> None:
        if self.active:
            with self._liveness.naming_lost_ranks():
                for partner in self._partners:
                    dist.send(torch.tensor([DONE, self._steps], dtype=torch.int64), dst=partner, group=self._group)
        elif self._server is not None:
            self._server.join(self._timeout_s)
            if self._server.is_alive():
                raise RuntimeError(f"gossip.mode=async: rank {self.rank} heard no end from active ranks "
                                   f"{self._actives} within {self._timeout_s:g} s")
            if self._failed is not None:
                raise RuntimeError(f"gossip.mode=async: rank {self.rank}'s averages failed: {self._failed}")
        with self._liveness.naming_lost_ranks():
            self._final_ops = self._gather_final_ops()
        with torch.no_grad():
            self._flat.copy_(self._x)  # the model is x, not the last snapshot
        super().close()

    def _gather_final_ops(self) -> dict[str, list[list[int]]]:
        """The averages each passive served after its last step (no step record holds them),
        [version, active, step] each, from every rank: rank 0's summary keeps them."""
        mine = torch.tensor([[v, a, k] for v, _, a, k in self._ops], dtype=torch.int64).reshape(-1, 3)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(counts, torch.tensor([len(mine)], dtype=torch.int64))
        most = max(int(c) for c in counts)
        padded = torch.zeros(most, 3, dtype=torch.int64)
        padded[: len(mine)] = mine
        gathered = [torch.zeros(most, 3, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(gathered, padded)
        return {str(r): g[: int(c)].tolist() for r, (g, c) in enumerate(zip(gathered, counts)) if int(c)}

    def report(self) -> dict:
        return {**super().report(), "gossip_final_ops": self._final_ops}
