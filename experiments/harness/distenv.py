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
    restarts: int = 0
    """How many times the launcher has restarted this job's workers (0: the first attempt);
    $PSAR_RESTARTS, or torchrun's $TORCHELASTIC_RESTART_COUNT."""

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
        if not addr and env.get("SLURM_JOB_NODELIST"):  # Slurm: rank 0 runs on the job's first host
            addr, port = first_host(env["SLURM_JOB_NODELIST"]), port or str(SLURM_PORT)
        restarts = _int(env, RESTARTS_ENV, _int(env, "TORCHELASTIC_RESTART_COUNT", 0))
        return cls(rank, world, local_rank, local_world, tuple(servers), f"{addr}:{port}" if addr and port else "",
                   restarts)


RESTARTS_ENV = "PSAR_RESTARTS"
"""Set by `psar run` and `psar launch --max-restarts K` to the number of restarts so far."""


SLURM_PORT = 29500
"""torch.distributed's rendezvous port under Slurm when MASTER_PORT is not set (torchrun's default)."""


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    head = nodelist.strip()
    depth = 0
    for i, c in enumerate(head):  # the first entry: up to a comma outside brackets
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, _, rest = head.partition("[")
    first = rest.split("]", 1)[0].split(",")[0].split("-")[0]
    return prefix + first + rest.split("]", 1)[1] if "]" in rest else prefix + first


def _int(env, name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
