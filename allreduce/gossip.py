"""Decentralized SGD, the engine gossip: D-PSGD (Lian et al., NeurIPS 2017, Algorithm 1).

Each worker keeps a model of its own. At step k worker i computes its gradient at its own
parameters x_i, and its new parameters are the weighted mean of its neighbours' and its own
plus its own update:

    x_i <- sum_j W_ij x_j + delta_i,    delta_i = the optimizer's step from x_i on g_i

(with plain SGD delta_i = -lr g_i, the paper's update). The optimizer and its state (momentum,
Adam's moments) are each worker's own, stepped on its own gradient at its own parameters, and
never averaged: momentum sits inside delta_i. W is the topology's (allreduce/topology.py),
doubly stochastic, so the workers' mean moves by the mean of their updates.

The exchange of x_i^k overlaps the step's compute: the parameters are final when step k-1
ends, so their point-to-point sends and receives (torch.distributed's isend and irecv: Gloo on
CPU, NCCL on CUDA) start then and are waited for only in step k, after backward. The model
lives in one flat buffer (the parameters are views of it), which is what is sent; each
neighbour's arrives in a buffer of its own. No step needs every worker, only its neighbours.

A checkpoint (checkpoint.every) holds each worker's own model and optimizer state, and a
resumed worker goes on from its own (keep_restored). A script's own checkpoint, saved by rank 0,
holds worker 0's: resumed from it, every worker starts again from worker 0's model.

The consensus distance, the mean over workers of ||x_i - mean x||^2, is measured every
gossip.consensus_every steps and at close (an all-reduce of the model, apart from the step's
bytes); after the run every worker's parameters (and floating buffers, BatchNorm's statistics)
are the workers' mean, the run's model.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from .backward_state import BackwardStates
from .gossip_config import GossipConfig
from .group import broadcast_tensors, init_process_group, shutdown
from .liveness import Liveness
from .topology import mixing_row, peers
from .zero_buckets import nbytes


class GossipEngine:
    """Engine protocol (attach / backward / step / close) of decentralized SGD on a graph."""

    def __init__(self, rank: int, world: int, device: torch.device, config: GossipConfig,
                 timeout_s: float = 60.0, trace=None, delay_s: float = 0.0) -> None:
        """delay_s: an injected one-way link latency (fault.delay_ms, net.latency_ms without
        netem): a step's models leave delay_s after the step that made them ended, from a
        thread of their own while the next step computes, so that they arrive when a link
        with that delay would deliver them (netem's: every byte delay_s late, so that a model
        arrives its transfer plus the delay after it was sent)."""
        self.rank, self.world, self.device, self.config, self.trace = rank, world, device, config, trace
        self.delay_s, self._timeout_s = delay_s, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="psar-delay") if delay_s else None
        self._sending: Future | None = None  # the delayed sends' works
        self.shards = [rank]
        init_process_group(device, rank, world, timeout_s)
        self._liveness = Liveness(rank, world)
        self._backward_states = BackwardStates(timeout_s)
        self._steps = 0
        self._works: list = []
        self._inbox: list[torch.Tensor] = []  # one buffer per model received in a step
        self.consensus_distance: float | None = None
        self._restored = False

    # -- set-up --------------------------------------------------------------------------------

    def keep_restored(self, step: int) -> None:
        """Each worker's model was restored from its own checkpoint, taken after `step` steps:
        attach keeps it, and the graph's schedule goes on from there."""
        self._restored, self._steps = True, step

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        if not self._restored:
            with self._liveness.naming_lost_ranks():  # every worker starts from rank 0's model
                broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        params = [p for p in model.parameters() if p.requires_grad]
        kinds = sorted({(str(p.dtype), str(p.device)) for p in params})
        if len(kinds) != 1:
            raise ValueError(f"gossip sends the model as one buffer: its trained parameters must share one dtype "
                             f"and device, not {kinds}")
        self._model, self._params = model, params
        self._flat = torch.cat([p.detach().reshape(-1) for p in params])
        offset = 0
        with torch.no_grad():
            for p in params:
                p.data = self._flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
        self._mix = torch.empty_like(self._flat)  # sum_j W_ij x_j - x_i, each step
        self.optimizer = make_optimizer(params)
        self._start_exchange()
        return model

    # -- the exchange --------------------------------------------------------------------------

    def _start_exchange(self) -> None:
        """Send this worker's parameters to the step's out-neighbours and receive its
        in-neighbours' (the step the next step() ends)."""
        to, sources = peers(self.config.topology, self.rank, self.world, self._steps)
        self._row = mixing_row(self.config.topology, self.rank, self.world, self._steps)
        self._sources = sources
        while len(self._inbox) < len(sources):
            self._inbox.append(torch.empty_like(self._flat))
        self._sent = len(to) * nbytes(self._flat)
        self._works = [dist.irecv(self._inbox[i], src=j) for i, j in enumerate(sources)]
        if self._pool is None:
            self._works += [dist.isend(self._flat, dst=j) for j in to]
            return

        def delayed() -> list:  # nothing else of the group runs until step() has these
            time.sleep(self.delay_s)
            return [dist.isend(self._flat, dst=j) for j in to]
        self._sending = self._pool.submit(delayed)

    def _finish_exchange(self) -> None:
        if self._sending is not None:
            sending, self._sending = self._sending, None
            self._works += sending.result(timeout=self.delay_s + self._timeout_s)
        for work in self._works:
            work.wait()
        self._works = []

    # -- backward and step ---------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate over backward passes until the next step() on every engine;
        gossip communicates only in step(), so there is nothing to hold back."""
        yield

    def backward(self, loss: torch.Tensor) -> None:
        with self._liveness.naming_lost_ranks():
            self._backward_states.backward(loss)

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        with self._liveness.naming_lost_ranks():
            self._finish_exchange()
        comm_s = time.perf_counter() - start
        with torch.no_grad():  # (W_ii - 1) x_i + sum_j W_ij x_j, before x_i takes its own update
            torch.mul(self._flat, self._row[self.rank] - 1.0, out=self._mix)
            for buffer, j in zip(self._inbox, self._sources):
                self._mix.add_(buffer, alpha=self._row[j])
        self.optimizer.step()
        with torch.no_grad():
            self._flat.add_(self._mix)
        for p in self._params:
            p.grad = None
        self._steps += 1
        stats = {"comm_s": comm_s, "bytes_sent": self._sent, "bytes_recv": len(self._sources) * nbytes(self._flat)}
        if self._steps % self.config.consensus_every == 0:
            began = time.perf_counter()
            with self._liveness.naming_lost_ranks():
                stats["consensus_distance"] = self._consensus()
            stats["consensus_s"] = time.perf_counter() - began
        with self._liveness.naming_lost_ranks():
            self._start_exchange()
        return stats

    def _consensus(self) -> float:
        """The mean over workers of ||x_i - mean x||^2 (every worker calls it)."""
        mean = self._flat.detach().clone()
        dist.all_reduce(mean)
        mean.div_(self.world)
        square = (self._flat.detach().double() - mean.double()).pow(2).sum()
        dist.all_reduce(square)
        self.consensus_distance = float(square) / self.world
        return self.consensus_distance

    def comm_bytes(self) -> int:
        """The buffers the neighbours' models arrive in (memory's comm_buffers)."""
        return sum(nbytes(b) for b in self._inbox)

    # -- end -----------------------------------------------------------------------------------

    def report(self) -> dict:
        return {"consensus_distance": self.consensus_distance, "topology": self.config.topology}

    def close(self) -> None:
        with self._liveness.naming_lost_ranks():
            self._finish_exchange()  # the one started after the last step
            self._consensus()
            with torch.no_grad():  # the run's model: the workers' mean
                dist.all_reduce(self._flat)
                self._flat.div_(self.world)
                for buffer in self._model.buffers():
                    if buffer.is_floating_point():
                        dist.all_reduce(buffer)
                        buffer.div_(self.world)
        self._liveness.stop_stamping()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        with self._liveness.naming_lost_ranks():
            shutdown(self._backward_states)
        self._liveness.close()
