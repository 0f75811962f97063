"""The bytes of the tensors a worker holds, by what they are, each at its most: memory as an
axis beside time, counted from the tensors rather than from the process's resident memory
(which holds torch's own libraries and caches, the same for every engine).

params: the model's parameters; grads: their gradients (read after backward, before the
step frees or zeroes them); optimizer: the state tensors of the optimizer the worker steps
(none under a parameter server, whose shards keep theirs: memory_bytes_per_shard);
comm_buffers: what an engine holds only to communicate, where it counts it (zero's whole
gradients on their way to a reduce-scatter; ddp's buckets, copies of the gradients; 0 where
an engine communicates in place, as the all-reduce engine's buckets are the gradients). An engine that keeps its own
count (zero, whose parameters and gradients are sharded and freed) gives it as `memory`.
"""

from __future__ import annotations

from typing import Any

import torch

KEYS = ("params", "grads", "optimizer", "comm_buffers")


def nbytes(tensors) -> int:
    """Bytes of the tensors, each storage counted once (views into one buffer, tied weights)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_sparse:  # a row-sparse gradient: its rows and their ids
            t = t.coalesce() if not t.is_coalesced() else t
            total += t._values().numel() * t._values().element_size() + t._indices().numel() * 8
        elif isinstance(t, torch.Tensor) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def optimizer_bytes(optimizer: Any) -> int:
    if optimizer is None:
        return 0
    return nbytes(t for state in optimizer.state.values() for t in state.values())


COUNTED_STEPS = 2
"""Steps whose tensors are counted where the engine keeps no count of its own: a model's
parameters, gradients and optimizer state are all made by the end of its second step (the
first makes the state), and counting them costs 0.6 ms a step for gpt-char's 29 tensors,
inside the step's time."""


class MemoryPeaks:
    """A worker's peaks: before_step(model) after backward, after_step(model) after the step
    (the engine's own count every step; otherwise the tensors, in the first COUNTED_STEPS);
    changed() gives them once they have grown since it was last asked (for the step's record)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.most = dict.fromkeys(KEYS, 0)
        self._told: dict[str, int] = {}
        self._counted = 0  # steps whose tensors were counted

    def _own(self) -> dict | None:
        own = getattr(self.engine, "memory", None)
        return own if isinstance(own, dict) else None

    def before_step(self, model: torch.nn.Module) -> None:
        if self._own() is None and self._counted < COUNTED_STEPS:
            self._keep(params=nbytes(model.parameters()),
                       grads=nbytes(p.grad for p in model.parameters() if p.grad is not None))

    def after_step(self, model: torch.nn.Module) -> None:
        own = self._own()
        if own is not None:
            self._keep(**own)
            return
        if self._counted >= COUNTED_STEPS:
            return
        self._counted += 1
        engine = self.engine
        optimizer = getattr(engine, "optimizer", None) or getattr(engine, "_optimizer", None)
        comm = getattr(engine, "comm_bytes", None)  # ddp: its reducer's copies of the gradients
        self._keep(params=nbytes(model.parameters()), optimizer=optimizer_bytes(optimizer),
                   comm_buffers=comm() if comm is not None else 0)

    def _keep(self, **held: int) -> None:
        for key, value in held.items():
            self.most[key] = max(self.most[key], int(value))

    def changed(self) -> dict | None:
        if self.most == self._told:
            return None
        self._told = dict(self.most)
        return dict(self.most)


def largest(records: list[dict]) -> dict | None:
    """memory_bytes_per_worker: each kind's most over every rank's records (None: none kept)."""
    kept = [r["memory"] for r in records if isinstance(r.get("memory"), dict)]
    if not kept:
        return None
    return {key: max(m.get(key, 0) for m in kept) for key in KEYS}
