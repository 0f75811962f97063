"""torch DistributedDataParallel as an engine: the reference the all-reduce is measured against."""

from __future__ import annotations

import gc

import torch
from torch.nn.parallel import DistributedDataParallel

from .backward_state import BackwardStates
from .collective import bus_bytes
from .compression import WIRE_DTYPES
from .config import AllReduceConfig
from .group import init_process_group, shutdown
from .liveness import Liveness


def synchronize_passes_cpu() -> None:
    """Let torch.cuda.synchronize pass a CPU device, as there is nothing to wait for on one.

    torch's powerSGD_hook synchronizes its bucket's device whenever CUDA is available, and
    torch 2.11 raises for a CPU device there ("Expected a cuda device, but got: cpu"): a DDP
    job with PowerSGD on the CPU of a GPU host failed at its first compressed step. Calls
    for CUDA devices, or for none, are torch's own. Idempotent."""
    original = torch.cuda.synchronize
    if getattr(original, "passes_cpu", False):
        return

    def synchronize(device=None):
        if isinstance(device, (torch.device, str)) and torch.device(device).type == "cpu":
            return None
        return original(device)

    synchronize.passes_cpu = True
    torch.cuda.synchronize = synchronize


class DDPEngine:
    """DDP's reducer waits for its buckets inside backward, so its exposed communication is
    counted in compute time and `comm_s` is 0. compression: (PowerSGD compressor, its
    error-feedback memory or None), experiments/compression's: its settings go to torch's own
    powerSGD_hook (the reference psar's PowerSGD is tested against), and its rule of which
    gradients travel as P and Q counts the bytes."""

    def __init__(self, rank: int, world: int, device: torch.device, config: AllReduceConfig,
                 timeout_s: float = 60.0, compression=None) -> None:
        if compression is not None and compression[0].name != "powersgd":
            raise ValueError(f"compress.method={compression[0].name}: ddp runs powersgd through torch's hook, "
                             "and the casts as allreduce.compression")
        if compression is not None and config.period > 1:
            raise ValueError("compress.method with allreduce.period > 1: one hook at a time")
        if compression is not None and config.compression != "none":
            raise ValueError(f"PowerSGD and allreduce.compression={config.compression}: one compression at a time")
        self.rank, self.world, self.device, self.config = rank, world, device, config
        self._compression, self._steps = compression, 0
        self._module: _NamingLostRanks | None = None  # what attach returns
        self.shards = [rank]
        init_process_group(device, rank, world, timeout_s)
        self._liveness = Liveness(rank, world)
        self._backward_states = BackwardStates(timeout_s)

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        ids = [self.device] if self.device.type == "cuda" else None
        with self._liveness.naming_lost_ranks():  # DDP broadcasts rank 0's state here
            self._ddp = DistributedDataParallel(
                model, device_ids=ids, bucket_cap_mb=self.config.bucket_cap_mb,
            )  # buffers: rank 0's at every forward, DDP's default (torch 2.13 warns when it is named)
        wire = WIRE_DTYPES[self.config.compression]
        if wire is not None:  # torch's own hooks, the reference for the allreduce engine's casts
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            hook = default_hooks.fp16_compress_hook if wire == torch.float16 else default_hooks.bf16_compress_hook
            self._ddp.register_comm_hook(None, hook)
        params = [p for p in model.parameters() if p.requires_grad]
        itemsize = 2 if wire is not None else params[0].element_size()
        self._grad_bytes = bus_bytes(sum(p.numel() for p in params) * itemsize, self.world)
        if self._compression is not None:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hooks

            synchronize_passes_cpu()
            c, memory = self._compression
            state = hooks.PowerSGDState(process_group=None, matrix_approximation_rank=c.rank,
                                        start_powerSGD_iter=c.start_step, use_error_feedback=memory is not None,
                                        warm_start=True, random_seed=c.seed,
                                        min_compression_rate=c.min_compression_rate)
            self._ddp.register_comm_hook(state, hooks.powerSGD_hook)
            sent = sum(c.compressed_nbytes(tuple(q.shape), q.dtype) if c.compresses(tuple(q.shape), c.start_step)
                       else q.numel() * itemsize for q in params)
            self._compressed_bytes = bus_bytes(sent, self.world)
        self.optimizer = make_optimizer(params)
        self._param_bytes = bus_bytes(sum(p.numel() * p.element_size() for p in params), self.world)
        if self.config.period > 1:  # torch's post-local SGD: the reference for the allreduce engine's
            if wire is not None:
                raise ValueError(f"allreduce.period={self.config.period} with allreduce.compression="
                                 f"{self.config.compression}: one hook at a time")
            from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as local
            from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
            from torch.distributed.optim import PostLocalSGDOptimizer

            warmup = self.config.period_warmup
            self._ddp.register_comm_hook(local.PostLocalSGDState(
                process_group=None, subgroup=None, start_localSGD_iter=warmup,
                post_local_gradient_allreduce=False), local.post_localSGD_hook)
            self.optimizer = PostLocalSGDOptimizer(self.optimizer, PeriodicModelAverager(
                period=self.config.period, warmup_steps=warmup))
        self._module = _NamingLostRanks(self._ddp, self._liveness)
        return self._module

    def no_sync(self):
        """DDP's own no_sync (around the forward too: DDP reads it there)."""
        return self._ddp.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        with self._liveness.naming_lost_ranks():  # DDP's all-reduces finish inside backward
            self._backward_states.backward(loss)

    def step(self) -> dict[str, float]:
        with self._liveness.naming_lost_ranks():  # under local SGD the averaging is in here
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        # torch's hook sends whole gradients for its first start_step iterations (one per step
        # here, outside no_sync), then P and Q for the matrices it compresses.
        compressing = self._compression is not None and self._steps >= self._compression[0].start_step
        period, warmup = self.config.period, self.config.period_warmup
        if period > 1 and self._steps >= warmup:  # local steps; the parameters every period
            nbytes = self._param_bytes if (self._steps - warmup) % period == 0 else 0
        else:
            nbytes = self._compressed_bytes if compressing else self._grad_bytes
        self._steps += 1
        return {"comm_s": 0.0, "bytes_sent": nbytes, "bytes_recv": nbytes}

    def comm_bytes(self) -> int:
        """The bytes of DDP's own gradient buckets: copies of the gradients it all-reduces
        (gradient_as_bucket_view is off), as its logging data gives their sizes; 0 where it
        does not say."""
        try:
            data = self._ddp._get_ddp_logging_data()
        except (AttributeError, RuntimeError):
            return 0
        if data.get("gradient_as_bucket_view"):
            return 0
        return sum(int(size) for size in str(data.get("bucket_sizes", "")).split(",") if size.strip().isdigit())

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        self._liveness.stop_stamping()  # before rank 0's shutdown takes the store down
        with self._liveness.naming_lost_ranks():
            shutdown(self._backward_states, release=self._release)
        self._liveness.close()

    def _release(self) -> None:
        """DDP's reducer is destroyed now, while the process group stands: destroyed after a
        script's own destroy_process_group, at the interpreter's teardown, it hung a rank in
        Gloo's native code (1 run in about 40, 2 cores busy)."""
        if self._module is not None:
            self._module.release()
        self._ddp = None
        gc.collect()


class _NamingLostRanks(torch.nn.Module):
    """The module a script calls: forward goes through DDP, while parameters, buffers,
    submodules and so state_dict are the model's own, with the model's keys ("fc.weight", as
    under every other engine; DDP's own would be "module.fc.weight"). DDP broadcasts rank 0's
    buffers inside forward, a collective like the others: a rank lost while it runs is named
    too, not reported as a raw connection error."""

    def __init__(self, ddp: DistributedDataParallel, liveness: Liveness) -> None:
        super().__init__()
        model = ddp.module
        # The model's own tables, not copies: the same tensors, under the same names.
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        object.__setattr__(self, "_ddp", ddp)  # not a submodule: its names would prefix the keys
        object.__setattr__(self, "_model", model)
        self._liveness = liveness

    def forward(self, *args, **kwargs):
        if self._ddp is None:  # after job.close(): the model alone (an evaluation, say)
            return self._model(*args, **kwargs)
        with self._liveness.naming_lost_ranks():
            return self._ddp(*args, **kwargs)

    def release(self) -> None:
        """Let go of DDP (its reducer and hooks) while the process group still stands; from
        now on forward is the model's own."""
        object.__setattr__(self, "_ddp", None)

    def train(self, mode: bool = True) -> "_NamingLostRanks":
        self._model.train(mode)  # the model's own flag too: its forward may read self.training
        self.training = mode
        return self
