"""ZeRO (Rajbhandari et al., SC'20), the sharded data-parallel family: the engine `zero`.

The trained parameters are cut into buckets by bytes, in the order backward produces their
gradients (allreduce/buckets.py, as the all-reduce engine's). Each bucket is one flat buffer
padded to a multiple of N, and each rank owns one of its N equal pieces (DeepSpeed's and
FSDP's even split, cutting tensors where it must), so it owns 1/N of every byte count. The
optimizer (make_optimizer's) runs over the owned pieces only, so its state is 1/N of a
replica's; under stages 1 and 2 a piece shares its storage with the bucket's buffer, so a
step updates the parameters it owns in place.

- zero.stage=1: the optimizer state is sharded. Each rank keeps a whole gradient buffer (the
  parameters' .grad are views into it); as soon as backward has produced a bucket's gradient
  it is averaged and reduce-scattered to the owners; the owners step; the updated pieces are
  all-gathered into every rank's parameters: 2(N-1)/N of the model's bytes a step, as the
  paper's stage 1 (an all-reduce of the gradient and then the all-gather would send 3(N-1)/N).
- zero.stage=2: the gradients are sharded too: each parameter's gradient is copied into its
  bucket's buffer as soon as backward has produced it, and its .grad freed; the buffer is
  reduce-scattered once full and freed once sent (DeepSpeed's reduce bucket); a rank keeps
  only the gradient of what it owns.
- zero.stage=3: the parameters are sharded too, each module's gathered only while it is
  used (allreduce/zero_units.py).

Collectives are the backend's (zero.algorithm=library: Gloo on CPU, NCCL on CUDA; rank r owns
piece r) or the two halves of psar's own ring (ring: allreduce/ring.py; rank r owns piece
(r + 1) mod N, where its reduce-scatter leaves the sum), started in bucket order on every
rank. BatchNorm statistics follow rank 0's, broadcast each step as under DDP. A checkpoint
is in torch's layout, the optimizer's state put together from every rank's pieces
(allreduce/zero_state.py).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from .backward_state import BackwardStates
from .buckets import assign_buckets
from .group import broadcast_tensors, init_process_group, shutdown
from .liveness import Liveness
from .zero_buckets import Bucket, LibraryCollectives, RingCollectives, nbytes
from .zero_config import ZeroConfig
from .zero_state import ZeroState
from .zero_units import Units

MEMORY_KEYS = ("params", "grads", "optimizer", "comm_buffers")
IN_FLIGHT = 2
"""Stages 2 and 3: gradient buffers being reduce-scattered at once, besides the newest; a
bucket waits for the oldest beyond that (DeepSpeed's reduce buckets, FSDP's rate limit)."""


class ZeroEngine(Units, ZeroState):
    """Engine protocol (attach / backward / step / close) of ZeRO stage config.stage."""

    def __init__(self, rank: int, world: int, device: torch.device, config: ZeroConfig,
                 timeout_s: float = 60.0, trace=None, delay_s: float = 0.0) -> None:
        """delay_s: an injected latency of every hop of psar's ring (zero.algorithm=ring; the
        backend's collectives cannot take one)."""
        if delay_s and config.algorithm != "ring":
            raise ValueError(f"an injected delay (fault.delay_ms={1e3 * delay_s:g}) needs zero.algorithm=ring: "
                             f"zero.algorithm={config.algorithm}'s collectives are the backend's")
        self.rank, self.world, self.device, self.config, self.trace = rank, world, device, config, trace
        self.shards = [rank]
        init_process_group(device, rank, world, timeout_s)
        self._collectives = RingCollectives(rank, world, delay_s) if config.algorithm == "ring" else \
            LibraryCollectives(rank, world)
        self._liveness = Liveness(rank, world)
        self._backward_states = BackwardStates(timeout_s)
        self._syncing = True
        self._bytes = 0
        self._waited = 0.0
        self._next = 0
        self._began, self._backward_s, self._stalled = 0.0, 0.0, 0.0
        self._released: list[list] = []  # stages 1 and 2: [seconds of backward before it, bytes] of each reduce-scatter
        self._sending: list[Bucket] = []  # stages 2 and 3: buffers being reduce-scattered, oldest first
        self._versions: list[int] = []  # stage 1: the gradient buffers' as backward left them
        self._held = 0  # their bytes, and those of the whole gradients waiting for their bucket
        self.memory = dict.fromkeys(MEMORY_KEYS, 0)  # the most each held at once, in bytes

    # -- set-up --------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        with self._liveness.naming_lost_ranks():
            broadcast_tensors(list(model.parameters()) + list(model.buffers()))
        self._buffers = list(model.buffers())
        if self.config.stage == 3:
            self._attach_units(model)
        else:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            order = assign_buckets([p.numel() * p.element_size() for _, p in named],
                                   cap_bytes=int(self.config.bucket_mb * 2**20),
                                   first_cap_bytes=int(self.config.first_bucket_mb * 2**20),
                                   groups=[(p.dtype, p.device) for _, p in named])
            self.buckets = [self._make_bucket([named[i] for i in indices]) for indices in order]
        self._slot = {p: (b, j) for b, bucket in enumerate(self.buckets) for j, p in enumerate(bucket.params)}
        self._views = {p: p.grad for p in self._slot} if self.config.stage == 1 else {}  # views of the buffers
        self.optimizer = make_optimizer([bucket.piece for bucket in self.buckets])
        self._keep_torchs_layout(model)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._slot]
        self._note()
        return model

    def _make_bucket(self, named: list[tuple[str, torch.nn.Parameter]], sharded: bool = False) -> Bucket:
        """One bucket of the parameters `named`, whose .data become views of its buffer.
        sharded (stage 3): this rank's piece gets storage of its own."""
        params = [p for _, p in named]
        numel = sum(p.numel() for p in params)
        size = -(-numel // self.world)  # each rank's piece; the buffer is padded to N of them
        values = torch.zeros(size * self.world, dtype=params[0].dtype, device=params[0].device)
        grad = torch.zeros_like(values) if self.config.stage == 1 else None
        offsets = [0]
        with torch.no_grad():
            for p in params:
                offset = offsets[-1]
                values[offset: offset + p.numel()].copy_(p.reshape(-1))
                p.data = values[offset: offset + p.numel()].view_as(p)
                if grad is not None:
                    p.grad = grad[offset: offset + p.numel()].view_as(p)
                offsets.append(offset + p.numel())
        own = self._collectives.owner  # which of the N pieces is this rank's
        mine = slice(own * size, (own + 1) * size)
        piece = torch.nn.Parameter(values[mine].clone() if sharded else values[mine])
        # stage 1 reduce-scatters in place: this rank's part of the whole gradient is its piece's
        piece.grad = grad[mine] if grad is not None else torch.zeros_like(piece)
        return Bucket([n for n, _ in named], params, values, piece, offsets[:-1], grad)

    # -- backward ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in here only accumulate the gradients (DDP's no_sync); the next
        backward outside it reduce-scatters the sum."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def backward(self, loss: torch.Tensor) -> None:
        if self.config.stage == 1:  # a script may have replaced a .grad: it goes back into the buffer
            for p, view in self._views.items():
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view
        if self.config.stage == 3:
            self._start_backward()
        self._began, self._released, self._stalled = time.perf_counter(), [], 0.0
        with self._liveness.naming_lost_ranks():
            self._backward_states.backward(loss)
            if not self._syncing:
                return
            start = time.perf_counter()
            self._backward_s = start - self._began - self._stalled  # backward's own, without its waits
            self._finish()
            self._waited += time.perf_counter() - start

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._syncing:
            return
        b, j = self._slot[param]
        bucket = self.buckets[b]
        bucket.ready.add(j)
        if self.config.stage > 1:  # into the bucket's gradient buffer, and the parameter's .grad freed
            if bucket.filling is None:
                bucket.filling = torch.zeros_like(bucket.values)
                self._transient(nbytes(bucket.filling))
            offset = bucket.offsets[j]
            bucket.filling[offset: offset + param.numel()].copy_(param.grad.reshape(-1))
            param.grad = None
        while self._next < len(self.buckets) and \
                len(self.buckets[self._next].ready) == len(self.buckets[self._next].params):
            self._reduce(self._next)
            self._next += 1

    def _reduce(self, b: int) -> None:
        """Average the bucket's gradient and reduce-scatter it: this rank's piece lands in
        bucket.piece.grad. Under stages 2 and 3 the buffer the gradients were copied into as
        they came goes once its reduce-scatter is done, and at most IN_FLIGHT of them are being
        reduce-scattered (besides the newest)."""
        bucket = self.buckets[b]
        ready = round(time.perf_counter() - self._began - self._stalled, 6)  # before any wait for buffers
        if bucket.grad is not None:
            flat = bucket.grad
        else:
            self._release(IN_FLIGHT)
            flat, bucket.filling = bucket.filling, None
            bucket.sending = flat
            self._sending.append(bucket)
        flat.div_(self.world)  # averaged before the sum, as the all-reduce engine does
        self._released.append([ready, nbytes(flat)])
        bucket.handle = self._collectives.reduce_scatter(bucket.piece.grad, flat)
        self._bytes += nbytes(flat) * (self.world - 1) // self.world
        if self.config.stage == 3:  # its backward is done: the values go until the next forward
            self._free(b)

    def _release(self, most: int, timed: bool = True) -> None:
        """Free the gradient buffers whose reduce-scatter is done; wait for the oldest while
        more than `most` of them are in flight (timed: the wait counts as the step's
        communication; _finish times its own)."""
        while self._sending:
            oldest = self._sending[0]
            if not oldest.handle.is_completed() and len(self._sending) <= most:
                return
            began = time.perf_counter()
            oldest.handle.wait()
            waited = (time.perf_counter() - began) * timed
            self._waited += waited
            self._stalled += waited  # backward's times leave it out
            self._transient(-nbytes(oldest.sending))
            oldest.sending = None
            self._sending.pop(0)

    def _transient(self, change: int) -> None:
        """Gradient buffers filling or being reduce-scattered: comm_buffers at its most."""
        self._held += change
        self.memory["comm_buffers"] = max(self.memory["comm_buffers"], self._held)

    def _finish(self) -> None:
        """Every bucket's reduce-scatter started (in order) and waited for."""
        missing = [bucket.names[j] for bucket in self.buckets for j in range(len(bucket.params))
                   if j not in bucket.ready]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise RuntimeError(f"{len(missing)} parameter(s) got no gradient this step: {shown}; under zero "
                               "every rank must use every parameter")
        self._release(0, timed=False)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle, bucket.ready = None, set()
        self._mark_gradients()
        self._next = 0
        self._note()

    # -- step ----------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient by its global norm (torch's clip_grad_norm_ under DDP):
        each rank's sum of squares of its pieces, all-reduced. Returns the norm before."""
        if norm_type != 2.0:
            raise NotImplementedError(f"job.clip_grad_norm_ with norm_type={norm_type} under zero: the 2-norm only")
        square = torch.stack([b.piece.grad.double().pow(2).sum() for b in self.buckets]).sum()
        with self._liveness.naming_lost_ranks():
            dist.all_reduce(square)
        total = square.sqrt()
        coefficient = min(1.0, max_norm / (float(total) + 1e-6))
        if coefficient < 1.0:
            for bucket in self.buckets:
                bucket.piece.grad.mul_(coefficient)
        self._mark_gradients()
        return total

    def _mark_gradients(self) -> None:
        """Stage 1: the gradient buffers' versions as backward (or job.clip_grad_norm_) left them."""
        self._versions = [b.grad._version for b in self.buckets if b.grad is not None]

    def _check_gradients(self) -> None:
        """Stage 1 keeps whole gradient buffers, but only its pieces of them are averaged over the
        ranks: a script that changed them after backward (torch's clip_grad_norm_ on the model)
        acted on the rest too, and is stopped before the step."""
        if [b.grad._version for b in self.buckets if b.grad is not None] != self._versions:
            raise RuntimeError("a gradient changed after job.backward reduce-scattered it (torch's clip_grad_norm_ "
                               "on the model?): under zero each rank holds the averaged gradient of its own pieces "
                               "only; clip with job.clip_grad_norm_(max_norm)")

    def step(self) -> dict[str, float]:
        self._check_gradients()
        self.optimizer.step()
        self._consolidated = None  # the state consolidated before is that of the last step
        self._note()
        start = time.perf_counter()
        with self._liveness.naming_lost_ranks():
            if self.config.stage < 3:  # in place, each piece its part of values (stage 3 gathers before each forward)
                works = [self._collectives.all_gather(b.values, b.piece.detach()) for b in self.buckets]
                for work in works:
                    work.wait()
                self._bytes += sum(nbytes(b.values) * (self.world - 1) // self.world for b in self.buckets)
            if self._buffers:
                self._bytes += broadcast_tensors(self._buffers) * (self.rank == 0)
        in_backward, self._waited = self._waited, 0.0
        for bucket in self.buckets:
            (bucket.grad if bucket.grad is not None else bucket.piece.grad).zero_()
        self._mark_gradients()
        sent, self._bytes = self._bytes, 0
        stats = {"comm_s": time.perf_counter() - start + in_backward, "in_backward_s": in_backward,
                 "bytes_sent": sent, "bytes_recv": sent}
        if self.config.stage < 3 and self._released and self._backward_s:  # what psar predict plays
            stats["backward_s"], stats["buckets"] = self._backward_s, self._released
        self._released, self._backward_s = [], 0.0
        return stats

    def _note(self) -> None:
        """The bytes of what this rank holds now, each kept at its most."""
        pieces = sum(nbytes(b.piece) for b in self.buckets) if self.config.stage == 3 else 0  # their own storage
        held = {"params": sum(nbytes(b.values) for b in self.buckets if b.gathered) + pieces,
                "grads": sum(nbytes(b.grad) if b.grad is not None else nbytes(b.piece.grad) for b in self.buckets),
                "optimizer": sum(nbytes(t) for state in self.optimizer.state.values()
                                 for t in state.values() if isinstance(t, torch.Tensor))}
        for key, value in held.items():
            self.memory[key] = max(self.memory[key], value)

    # -- end -----------------------------------------------------------------------------------

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        with self._liveness.naming_lost_ranks():
            if self.config.stage == 3:  # the run's model, whole (model.pt, eval)
                self._gather_all()
            self._collectives.close()
        self._liveness.stop_stamping()
        with self._liveness.naming_lost_ranks():
            shutdown(self._backward_states)
        self._liveness.close()
