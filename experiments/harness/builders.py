"""psar's own engines, built from a run's config: the `build` of each registry entry."""

from __future__ import annotations

import torch

from experiments.settings.config import RunConfig
from experiments.harness.distenv import DistEnv
from experiments.engines import Engine, Trace, get_engine


def local(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from experiments.harness.local_engine import LocalEngine

    return LocalEngine(cfg.workers)


def allreduce(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from allreduce.engine import AllReduceEngine

    # The tables are named at attach, once the model exists; {} unless allreduce.sparse=allgather.
    from experiments.settings.net import parse_rate

    bandwidth = parse_rate(cfg.net.rate) / 8 if cfg.net.rate else None  # auto's model: the links' bytes/s
    # hierarchical's groups and auto's model: the racks given (None: by host, asked at attach)
    racks = tuple(cfg.net.worker_rack(r, env.world) for r in range(env.world)) if cfg.net.racks > 1 else None
    uplink = parse_rate(cfg.net.uplink) / 8 if cfg.net.uplink else None
    from allreduce.auto import crowding

    return AllReduceEngine(env.rank, env.world, device, cfg.allreduce, cfg.timeout_s, trace,
                           cfg.fault.delay_s, sparse_tables=cfg.sparse_tables, compression=compression(cfg),
                           bandwidth=bandwidth, racks=racks, uplink=uplink, crowded=crowding(env.local_world))


def ddp(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from allreduce.ddp import DDPEngine

    if cfg.fault.delay_ms:
        raise ValueError("fault.delay_ms cannot be applied to ddp: its messages are inside torch; "
                         "use --engine allreduce to study a slow link")
    return DDPEngine(env.rank, env.world, device, cfg.allreduce, cfg.timeout_s, compression=compression(cfg))


def zero(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from allreduce.zero import ZeroEngine

    return ZeroEngine(env.rank, env.world, device, cfg.zero, cfg.timeout_s, trace, cfg.fault.delay_s)


def gossip(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    if cfg.gossip.mode == "async":
        from allreduce.gossip_async import AsyncGossipEngine as GossipEngine
    else:
        from allreduce.gossip import GossipEngine

    return GossipEngine(env.rank, env.world, device, cfg.gossip, cfg.timeout_s, trace, cfg.fault.delay_s)


def ps(cfg: RunConfig, env: DistEnv, device: torch.device, trace: Trace | None) -> Engine:
    from ps.engine import PSEngine

    from experiments.settings.agreement import settings
    from experiments.settings.script import ScriptConfig, shard_initializer

    # fault.delay_ms is applied by the servers, which hold every reply back.
    common = dict(trace=trace, settings=settings(cfg),
                  initializer=shard_initializer(cfg) if isinstance(cfg.model, ScriptConfig) else None)
    if cfg.engine == "ps-easgd":
        from ps.easgd import EASGDEngine

        return EASGDEngine(env.rank, env.world, device, list(env.servers), cfg.ps, **common)
    # a user's script may read its parameters between steps: it gets every value in step()
    return PSEngine(env.rank, env.world, device, list(env.servers), get_engine(cfg.engine).consistency, cfg.worker_ps(),
                    compression=compression(cfg), rejoin=env.restarts > 0,
                    forward_loads=not isinstance(cfg.model, ScriptConfig), **common)


def compression(cfg: RunConfig):
    """(compressor, error-feedback memory or None) of compress.method, for the engines that
    carry it themselves; None for none and the casts (the engines' own wire dtypes)."""
    return cfg.compress.build() if cfg.carries_compressor() else None

