"""Process-group set-up and state broadcast for the all-reduce engines."""

from __future__ import annotations

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist

from .backward_state import BackwardStates


class SharedStore:
    """One rendezvous store for the jobs a process runs one after another (a batch of runs):
    job n's group meets under the key prefix "job<n>/" of a TCPStore made at the first job,
    which rank 0 serves at `master` (HOST:PORT, env://'s MASTER_ADDR:MASTER_PORT as
    experiments.harness.distenv reads them), for the process's life.

    With a store per job, every job after the first started half a second late: rank 0 is
    always the last to finish a job (it writes the model and summary), and a peer whose
    connection is refused retries only after a back-off. Every rank runs the same jobs in the
    same order, so their job counts agree.
    """

    def __init__(self, master: str) -> None:
        addr, _, port = master.rpartition(":")
        if not addr or not port.isdigit():
            raise ValueError(f"a batch of runs meets at MASTER_ADDR and MASTER_PORT: set both (got {master!r})")
        self.addr, self.port = addr, int(port)
        self.store: dist.TCPStore | None = None
        self.jobs = 0

    def next_job(self, rank: int, world: int, timeout_s: float) -> dist.Store:
        timeout = timedelta(seconds=timeout_s)
        if self.store is None:
            self.store = dist.TCPStore(self.addr, self.port, world, rank == 0, timeout)
        self.store.set_timeout(timeout)
        self.jobs += 1
        return dist.PrefixStore(f"job{self.jobs}/", self.store)


_shared: SharedStore | None = None


def share_store(master: str) -> None:
    """The jobs this process runs from now on meet on one store at master, HOST:PORT (see
    SharedStore)."""
    global _shared
    _shared = SharedStore(master)


def init_process_group(device: torch.device, rank: int, world: int, timeout_s: float) -> str:
    """Join the torch.distributed job (env:// rendezvous: MASTER_ADDR, MASTER_PORT), or the
    next job on the store share_store set up.

    Using env:// lets torchrun and Slurm launch the workers as they launch any PyTorch job.
    Returns the backend: NCCL on CUDA, Gloo on CPU.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if _shared is not None:
            kwargs["store"] = _shared.next_job(rank, world, timeout_s)
        else:
            kwargs["init_method"] = "env://"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                **kwargs)
    return backend


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> int:
    """Overwrite `tensors` in place with rank `src`'s values, one flat message per dtype.

    Returns the bytes broadcast.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    nbytes = 0
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        dist.broadcast(flat, src)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
        nbytes += flat.numel() * flat.element_size()
    return nbytes


_script_owns = False
"""Whether the process group is a user's script's (script_group): an engine's close then
leaves it to the script's own dist.destroy_process_group()."""


def script_group(device: torch.device, rank: int, world: int, timeout_s: float) -> str:
    """torch.distributed for a user's script, as after init_process_group under torchrun:
    the group the engine made (allreduce, ddp), or a new one on device's backend; from now on
    the script's. Destroyed at exit where the script does not destroy it. Returns the backend."""
    global _script_owns
    backend = init_process_group(device, rank, world, timeout_s)
    if not _script_owns:
        _script_owns = True
        atexit.register(_destroy_left)
    return backend


def _destroy_left() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown(backward_states: BackwardStates | None = None, release=None) -> None:
    """Leave the job after every rank has arrived, so no rank tears down a peer mid-message,
    and once this rank's backend threads have let go of the collectives started inside
    backward (see allreduce.backward_state); release(): what must go while the group still
    stands. A script's group (script_group) stays, for the script's own calls after
    job.close()."""
    if dist.is_initialized():
        dist.barrier()
        if backward_states is not None:
            backward_states.wait_released(f"rank {dist.get_rank()}")
        if release is not None:
            release()
        if not _script_owns:
            dist.destroy_process_group()


def racks_by_host(world: int) -> tuple[int, ...]:
    """Each rank's host, as the index of the first rank on the same host (hierarchical
    all-reduce's racks where none are given: the ranks of one machine reduce first). Every
    rank sends a hash of its host's name (one all-gather of an int64, no pickling)."""
    import socket
    import zlib

    mine = torch.tensor([zlib.crc32(socket.gethostname().encode())], dtype=torch.int64)
    hosts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(hosts, mine)
    names = [int(h.item()) for h in hosts]
    return tuple(names.index(n) for n in names)
