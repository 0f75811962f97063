"""Where this process stands in the job: the one place that reads RANK, WORLD_SIZE and friends."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    """Global rank of this worker."""
    world: int = 1
    """Number of workers."""
    local_rank: int = 0
    """Rank on this host (picks the GPU)."""
    local_world: int = 1
    """Workers on this host (shares the CPU cores)."""
    servers: tuple[str, ...] = ()
    """Parameter-server shard addresses, shard order (ps-* engines)."""
    master: str = ""
    """MASTER_ADDR:MASTER_PORT of torch.distributed's env:// rendezvous; "" when either is unset."""

    @classmethod
    def from_environ(cls, rank: int | None = None, world: int | None = None,
                     servers: tuple[str, ...] = ()) -> "DistEnv":
        """Explicit arguments win over the launcher's variables (torchrun, Slurm, psar run)."""
        env = os.environ
        rank = rank if rank is not None else _int(env, "RANK", _int(env, "SLURM_PROCID", 0))
        world = world if world is not None else _int(env, "WORLD_SIZE", _int(env, "SLURM_NTASKS", 1))
        local_rank = _int(env, "LOCAL_RANK", _int(env, "SLURM_LOCALID", rank))
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world} workers")
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        return cls(rank, world, local_rank, local_world, tuple(servers), f"{addr}:{port}" if addr and port else "")


def _int(env, name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
