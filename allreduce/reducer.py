"""Gradient buckets whose all-reduce starts from gradient hooks while backward still runs.

Each parameter's `.grad` is a view into its bucket's flat tensor, so autograd accumulates
straight into the bucket and no copy is made before or after the all-reduce (DDP's
`gradient_as_bucket_view`). Buckets are started strictly in bucket order, which every rank
shares, because collectives must be issued in the same order on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .buckets import assign_buckets
from .collective import Handle


class UnusedParameterError(ValueError):
    """A parameter that requires grad got none in a step."""


@dataclass
class Bucket:
    names: list[str]
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)
    handle: Handle | None = None
    layout: list[tuple[str, torch.Size]] = field(default_factory=list)
    """(name, shape) of its parameters, in its order (what a PowerSGD exchange cuts it into)."""


class Reducer:
    """Owns the gradient buckets of one model replica.

    Args:
        named_params: (name, parameter) pairs in `model.named_parameters()` order; those
            that do not require grad are left out.
        collective: a `LibraryAllReduce` or `RingAllReduce` (its `start(flat, wire_dtype)`).
        world: number of ranks the gradient is averaged over.
        cap_mb / first_cap_mb: bucket caps in MiB (default 25 and 1).
        wire_dtype: dtype the buckets travel in, or None to send as they are.
        unused: 'error' raises naming parameters that got no gradient; 'zero' reduces zeros.
        exchange: a CompressedExchange (allreduce/compressed.py): each bucket is compressed,
            with its error feedback, and combined by it in place of the plain all-reduce.
    """

    def __init__(self, named_params, collective, world: int, cap_mb: float = 25.0,
                 first_cap_mb: float = 1.0, wire_dtype: torch.dtype | None = None,
                 unused: str = "error", exchange=None) -> None:
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.collective, self.world = collective, world
        self.wire_dtype, self.unused, self.exchange = wire_dtype, unused, exchange
        self._steps = 0  # reductions finished: the compressors' step
        order = assign_buckets(
            [p.numel() * p.element_size() for _, p in named],
            cap_bytes=int(cap_mb * 2**20),
            first_cap_bytes=int(first_cap_mb * 2**20),
            groups=[(p.dtype, p.device) for _, p in named],
        )
        self.buckets: list[Bucket] = []
        self._slot: dict[torch.nn.Parameter, tuple[int, int]] = {}
        for b, indices in enumerate(order):
            params = [named[i][1] for i in indices]
            flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                               device=params[0].device)
            self.buckets.append(Bucket([named[i][0] for i in indices], params, flat,
                                       layout=[(named[i][0], named[i][1].shape) for i in indices]))
            offset = 0
            for j, p in enumerate(params):
                self._slot[p] = (b, j)
                p.grad = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
        self._views = {p: p.grad for p in self._slot}
        self._next = 0
        self.bytes_sent = 0
        self.syncing = True  # False inside no_sync: gradients only accumulate in the buckets
        self._began = 0.0
        self.timeline: list[tuple[float, int]] = []
        """(seconds from prepare(), bytes) of each bucket this step started, in order: when
        backward made it ready, or when finish() started what backward left."""
        self.backward_s = 0.0
        """Seconds from prepare() to finish(): the backward the buckets overlapped."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._slot]

    def prepare(self) -> None:
        """Before backward: make sure every .grad is still its bucket view; the step's
        timeline starts."""
        self._began, self.timeline = time.perf_counter(), []
        for p, view in self._views.items():
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.syncing:
            return
        b, j = self._slot[param]
        self.buckets[b].ready.add(j)
        self._start_ready()

    def _start_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.params):
                return
            self._start(bucket)
            self._next += 1

    def _start(self, bucket: Bucket) -> None:
        size = bucket.flat.numel() * bucket.flat.element_size()
        self.timeline.append((time.perf_counter() - self._began, size))
        name = f"all-reduce bucket {self._next} ({size / 2**20:.2f} MiB)"
        if self.exchange is not None:  # it averages once the messages are in
            bucket.handle, nbytes = self.exchange.start("+".join(bucket.names), bucket.flat, self._steps, name,
                                                        params=bucket.layout)
            self.bytes_sent += nbytes
            return
        # Average before the cast so that fp16 cannot overflow on the sum.
        bucket.flat.div_(self.world)
        bucket.handle, nbytes = self.collective.start(bucket.flat, self.wire_dtype, name)
        self.bytes_sent += nbytes

    def finish(self) -> float:
        """Wait for every bucket (a synchronisation point); return seconds spent waiting."""
        missing = [bucket.names[j] for bucket in self.buckets
                   for j in range(len(bucket.params)) if j not in bucket.ready]
        if missing and self.unused == "error":
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise UnusedParameterError(
                f"{len(missing)} parameter(s) got no gradient this step: {shown}; every rank "
                "must use every parameter, or set allreduce.unused=zero to reduce zeros for them"
            )
        self.backward_s = time.perf_counter() - self._began
        for bucket in self.buckets:
            bucket.ready = set(range(len(bucket.params)))  # unused ones reduce their zeros
        self._start_ready()
        start = time.perf_counter()
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
        waited = time.perf_counter() - start
        for bucket in self.buckets:
            bucket.ready = set()
        self._next = 0
        self._steps += 1
        return waited

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.flat.zero_()

    def take_bytes(self) -> int:
        sent, self.bytes_sent = self.bytes_sent, 0
        return sent

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
