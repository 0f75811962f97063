"""The bucketed all-reduce engine: hooks start each bucket's all-reduce during backward.

`step()` waits for the buckets, broadcasts rank 0's buffers (BatchNorm running statistics:
rank 0's are authoritative, as with DDP's broadcast_buffers), and runs the local optimizer.
"""

from __future__ import annotations

import time

import torch

from .collective import make_collective
from .compression import wire_dtype
from .config import AllReduceConfig
from .group import broadcast_tensors, init_process_group, shutdown
from .liveness import Liveness
from .reducer import Reducer


class AllReduceEngine:
    """Engine protocol (attach / backward / step / close) over a bucketed all-reduce."""

    def __init__(self, rank: int, world: int, device: torch.device, config: AllReduceConfig,
                 timeout_s: float = 60.0, trace=None, delay_s: float = 0.0) -> None:
        """trace: optional callable(name, start, end, thread=...) for each bucket's all-reduce;
        delay_s: injected latency of every message (a slow link)."""
        self.rank, self.world, self.device, self.config = rank, world, device, config
        self.trace, self.delay_s = trace, delay_s
        self.shards = [rank]
        init_process_group(device, rank, world, timeout_s)
        self._liveness = Liveness(rank, world)

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        with self._liveness.naming_lost_ranks():
            broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        self._buffers = [b for b in model.buffers()]
        self._collective = make_collective(self.config.algorithm, self.rank, self.world,
                                           self.trace, self.delay_s)
        params = list(model.named_parameters())
        self._reducer = Reducer(
            params, self._collective, self.world, cap_mb=self.config.bucket_cap_mb,
            first_cap_mb=self.config.first_bucket_mb,
            wire_dtype=wire_dtype(self.config.compression, params[0][1].dtype),
            unused=self.config.unused,
        )
        self.optimizer = make_optimizer([p for _, p in params if p.requires_grad])
        return model

    def backward(self, loss: torch.Tensor) -> None:
        self._reducer.prepare()
        with self._liveness.naming_lost_ranks():
            loss.backward()

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        with self._liveness.naming_lost_ranks():
            self._reducer.finish()
            nbytes = self._reducer.take_bytes()
            if self._buffers:
                nbytes += broadcast_tensors(self._buffers) * (self.rank == 0)
        comm_s = time.perf_counter() - start
        self.optimizer.step()
        self._reducer.zero_grad()
        return {"comm_s": comm_s, "bytes_sent": nbytes, "bytes_recv": nbytes}

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        self._reducer.close()
        with self._liveness.naming_lost_ranks():
            self._collective.close()
            shutdown()
        self._liveness.close()
