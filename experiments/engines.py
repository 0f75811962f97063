"""The engine protocol the training loop is written against, and the engines by name.

The loop never asks which engine it runs; an engine satisfies this protocol by shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch

from .config import RunConfig
from .distenv import DistEnv

MakeOptimizer = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
Trace = Callable[..., None]


class Engine(Protocol):
    shards: Sequence[int]
    """The data shards this process trains on each step: [rank], or all of them for `local`."""

    def attach(self, model: torch.nn.Module, make_optimizer: MakeOptimizer) -> torch.nn.Module:
        """Agree on initial parameters, install hooks; return the module to call forward on."""

    def backward(self, loss: torch.Tensor) -> None:
        """Run backward for one shard's loss; communication may start inside it."""

    def step(self) -> Mapping[str, float]:
        """Finish communication and update parameters; return this step's metrics
        (comm_s, bytes_sent, bytes_recv, and engine-specific ones such as staleness)."""

    def close(self) -> None:
        """Leave the job once every worker is done."""

    def report(self) -> Mapping:
        """After close: anything the run's summary should keep (e.g. the servers' counters)."""


@dataclass(frozen=True)
class EngineSpec:
    name: str
    summary: str
    processes_per_worker: bool
    """False when one process plays every worker (local)."""
    uses_servers: bool
    build: Callable[[RunConfig, DistEnv, torch.device, Trace | None], Engine]
    """Makes the engine; given a tracer's record function when the run is traced."""

    @property
    def rendezvous(self) -> bool:
        """Its workers meet through torch.distributed's env:// rendezvous (MASTER_ADDR/PORT)."""
        return self.processes_per_worker and not self.uses_servers


def _local(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from .local_engine import LocalEngine

    return LocalEngine(cfg.workers)


def _allreduce(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from allreduce.engine import AllReduceEngine

    # The tables are named at attach, once the model exists; {} unless allreduce.sparse=allgather.
    return AllReduceEngine(env.rank, env.world, device, cfg.allreduce, cfg.timeout_s, trace,
                           cfg.fault.delay_s, sparse_tables=cfg.sparse_tables)


def _ddp(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from allreduce.ddp import DDPEngine

    if cfg.fault.delay_ms:
        raise ValueError("fault.delay_ms cannot be applied to ddp: its messages are inside torch; "
                         "use --engine allreduce to study a slow link")
    return DDPEngine(env.rank, env.world, device, cfg.allreduce, cfg.timeout_s)


def _ps(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from ps.engine import MODES, PSEngine

    from .agreement import settings

    from .script import ScriptConfig, shard_initializer

    # fault.delay_ms is applied by the servers, which hold every reply back.
    return PSEngine(env.rank, env.world, device, list(env.servers), MODES[cfg.engine], cfg.ps, trace,
                    settings=settings(cfg),
                    initializer=shard_initializer(cfg) if isinstance(cfg.model, ScriptConfig) else None)


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in [
        EngineSpec("local", "one process accumulates every shard's gradient: the reference",
                   False, False, _local),
        EngineSpec("ddp", "torch DistributedDataParallel", True, False, _ddp),
        EngineSpec("allreduce", "bucketed all-reduce from gradient hooks (library or ring)",
                   True, False, _allreduce),
        EngineSpec("ps-sync", "parameter server, bulk synchronous: one averaged update per step",
                   True, True, _ps),
        EngineSpec("ps-async", "parameter server, Hogwild-style: every push applied on arrival",
                   True, True, _ps),
        EngineSpec("ps-ssp", "parameter server, stale synchronous: at most ps.staleness clocks ahead",
                   True, True, _ps),
    ]
}


def get_engine(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: expected one of {', '.join(ENGINES)}")
    return ENGINES[name]
