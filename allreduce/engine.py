"""The bucketed all-reduce engine: hooks start each bucket's all-reduce during backward.

As under DDP, every gradient is final when `backward()` returns: it waits for the buckets
and all-gathers the rows of the row-sparse embedding tables (allreduce.sparse=allgather;
they are left out of the buckets), so that a script may clip, read or log the averaged
gradients before `step()`. `step()` broadcasts rank 0's buffers (BatchNorm running
statistics: rank 0's are authoritative, as with DDP's broadcast_buffers) and runs the local
optimizer.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from .backward_state import BackwardStates
from .collective import make_collective
from .compressed import CompressedExchange, PowerSGDExchange
from .compression import wire_dtype
from .config import AllReduceConfig
from .group import broadcast_tensors, init_process_group, racks_by_host, shutdown
from .liveness import Liveness
from .reducer import Reducer
from .sparse import SparseAllGather

SparseTables = Callable[[torch.nn.Module], "dict[str, torch.nn.Module]"]


class AllReduceEngine:
    """Engine protocol (attach / backward / step / close) over a bucketed all-reduce."""

    def __init__(self, rank: int, world: int, device: torch.device, config: AllReduceConfig,
                 timeout_s: float = 60.0, trace=None, delay_s: float = 0.0,
                 sparse_tables: SparseTables | None = None, compression=None,
                 bandwidth: float | None = None, racks: tuple[int, ...] | None = None,
                 uplink: float | None = None, crowded: float = 1.0) -> None:
        """trace: optional callable(name, start, end, thread=...) for each bucket's all-reduce;
        delay_s: injected latency of every message (a slow link); sparse_tables: callable(model)
        -> {parameter name: nn.Embedding/EmbeddingBag} of the tables to all-gather row-sparse,
        asked at attach (default None: every table is all-reduced dense in the buckets);
        compression: (compressor, error-feedback memory or None), experiments/compression's,
        for the buckets (allreduce/compressed.py); bandwidth: the links' bytes per second,
        which allreduce.algorithm=auto's model reads (None: loopback's); racks: each rank's
        rack (None: by host, asked of the ranks when an algorithm needs them) and uplink,
        their uplinks' bytes/s, for hierarchical and auto; crowded: ranks per core on this
        machine (auto.crowding), what a message costs in auto's model."""
        if config.sparse == "allgather" and sparse_tables is None:
            raise ValueError("allreduce.sparse=allgather needs sparse_tables, the callable that "
                             "names the model's row-sparse tables")
        if compression is not None:
            compressor = compression[0]
            if config.compression != "none":
                raise ValueError(f"compress.method={compressor.name} and allreduce.compression="
                                 f"{config.compression}: one compression at a time")
            if not compressor.adds_up and (config.algorithm != "library" or delay_s):
                raise ValueError(f"compress.method={compressor.name} is all-gathered, through the "
                                 "library's all_gather: it needs allreduce.algorithm=library and no fault.delay_ms")
            if config.sparse == "allgather":
                raise ValueError(f"compress.method={compressor.name} with allreduce.sparse=allgather: "
                                 "the tables' rows would travel uncompressed; choose one")
        self._compression = compression
        self._exchange = None  # the compressed exchange, once attached
        self.rank, self.world, self.device, self.config = rank, world, device, config
        self.trace, self.delay_s, self.bandwidth = trace, delay_s, bandwidth
        self.racks, self.uplink, self.crowded = racks, uplink, crowded
        self._sparse_tables = sparse_tables
        self.shards = [rank]
        init_process_group(device, rank, world, timeout_s)
        self._liveness = Liveness(rank, world)
        self._backward_states = BackwardStates(timeout_s)
        self._waited, self._gathered = 0.0, 0  # this step's wait for its gradients, rows gathered
        self._steps = 0  # optimizer steps taken: local SGD's clock (allreduce.period)
        self._outer: list[torch.Tensor] | None = None  # DiLoCo: the model the workers share

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        # Before any collective, so that a refusal (an optimizer without sparse updates) is
        # raised alike on every rank instead of leaving the others waiting.
        tables = self._sparse_tables(model) if self._sparse_tables is not None else {}
        self._sparse = SparseAllGather(tables, self.world, self.config.compression)
        with self._liveness.naming_lost_ranks():
            broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        self._buffers = [b for b in model.buffers()]
        racks = self.racks
        if racks is None and self.config.algorithm in ("hierarchical", "auto"):
            with self._liveness.naming_lost_ranks():
                racks = racks_by_host(self.world)
        self._collective = make_collective(self.config.algorithm, self.rank, self.world, self.trace,
                                           self.delay_s, self.bandwidth, racks, self.uplink, self.crowded)
        params = list(model.named_parameters())
        bucketed = [(n, p) for n, p in params if n not in tables]  # the tables never get a bucket
        if self._compression is not None:
            compressor, memory = self._compression
            self._exchange = (
                PowerSGDExchange(compressor, memory, self.rank, self.world, self._collective, compressor.seed)
                if compressor.name == "powersgd" else
                CompressedExchange(compressor, memory, self.rank, self.world, self._collective))
        self._reducer = Reducer(
            bucketed, self._collective, self.world, cap_mb=self.config.bucket_cap_mb,
            first_cap_mb=self.config.first_bucket_mb,
            wire_dtype=wire_dtype(self.config.compression, params[0][1].dtype),
            unused=self.config.unused, exchange=self._exchange,
        )
        self.optimizer = make_optimizer([p for _, p in params if p.requires_grad])
        return model

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in here only accumulate the gradients (DDP's no_sync); the next
        backward outside it reduces the sum."""
        self._reducer.syncing = False
        try:
            yield
        finally:
            self._reducer.syncing = True

    @property
    def _local(self) -> bool:
        """Local SGD's phase (allreduce.period > 1, after the warm-up): each worker steps on
        its own gradients, and the parameters are averaged every period steps."""
        return self.config.period > 1 and self._steps >= self.config.period_warmup

    def backward(self, loss: torch.Tensor) -> None:
        self._reducer.prepare()
        with self._liveness.naming_lost_ranks():
            if self._local:  # the gradients stay this worker's own
                syncing, self._reducer.syncing = self._reducer.syncing, False
                try:
                    self._backward_states.backward(loss)
                finally:
                    self._reducer.syncing = syncing
                return
            self._backward_states.backward(loss)
            if not self._reducer.syncing:
                return
            start = time.perf_counter()  # the gradients' wait, counted as the step's communication
            self._reducer.finish()
            self._gathered += self._sparse.reduce()
            self._waited += time.perf_counter() - start

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        with self._liveness.naming_lost_ranks():
            nbytes = self._reducer.take_bytes()
            gathered, self._gathered = self._gathered, 0
            nbytes += gathered
            if self._buffers:
                nbytes += broadcast_tensors(self._buffers) * (self.rank == 0)
        in_backward, self._waited = self._waited, 0.0
        comm_s = time.perf_counter() - start + in_backward
        if self._local and self.config.outer != "none" and self._outer is None:
            self._start_outer()  # the shared model the first period starts from
        self.optimizer.step()
        if self._local and (self._steps - self.config.period_warmup) % self.config.period == 0:
            began = time.perf_counter()
            with self._liveness.naming_lost_ranks():
                nbytes += self._average_parameters()
            comm_s += time.perf_counter() - began
            if self._outer is not None:
                self._outer_step()
        self._steps += 1
        self._reducer.zero_grad()
        self._sparse.zero_grad()
        stats = {"comm_s": comm_s, "in_backward_s": in_backward, "bytes_sent": nbytes, "bytes_recv": nbytes}
        if self._reducer.timeline:  # when backward released each bucket (psar predict plays them)
            stats["backward_s"] = self._reducer.backward_s
            stats["buckets"] = [[round(at, 6), size] for at, size in self._reducer.timeline]
            self._reducer.timeline = []
        if self._exchange is not None:
            stats["compress_s"] = self._exchange.take_seconds()
        if self._sparse.params:  # what the all-gather of the tables' rows sent, apart (analysis models it)
            stats["gathered_bytes"] = gathered
        return stats

    def _stepped(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps, in its order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _average_parameters(self) -> int:
        """Every worker's parameters become their mean, as torch's average_parameters makes
        them: one flat buffer of the optimizer's parameters, divided by N, then all-reduced
        (bucketed in the collective's own way). The bytes this rank sent."""
        params = self._stepped()
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params]).div_(self.world)
            handle, nbytes = self._collective.start(flat, None, "average parameters")
            handle.wait()
            offset = 0
            for p in params:
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        return nbytes

    def _start_outer(self) -> None:
        """DiLoCo: a copy of the model the workers share, and the outer Nesterov SGD over it."""
        self._outer = [p.detach().clone() for p in self._stepped()]
        self._outer_optimizer = torch.optim.SGD(self._outer, lr=self.config.outer_lr,
                                                momentum=self.config.outer_momentum, nesterov=True)

    def _outer_step(self) -> None:
        """DiLoCo's outer step, once the parameters are the workers' mean: the outer gradient
        is the shared model less the mean, the step moves the shared model, and every worker's
        parameters become it."""
        params = self._stepped()
        with torch.no_grad():
            for shared, p in zip(self._outer, params):
                shared.grad = shared - p
            self._outer_optimizer.step()
            for shared, p in zip(self._outer, params):
                p.copy_(shared)

    def report(self) -> dict:
        chosen = getattr(self._collective, "chosen", None)
        out = {"algorithms_chosen": dict(chosen)} if chosen else {}
        racks = getattr(self._collective, "racks", None)
        return {**out, "racks": list(racks)} if racks is not None else out

    def close(self) -> None:
        self._reducer.close()
        self._liveness.stop_stamping()  # before rank 0's shutdown takes the store down
        with self._liveness.naming_lost_ranks():
            self._collective.close()
            shutdown(self._backward_states)
        self._liveness.close()
