"""The experiment's optimizer over a shard's chunks, stepped over any subset of them in one call.

A shard updates the keys of one push (async, ssp) or the keys every worker has now pushed
(sync) together. One torch optimizer holds every chunk and its state; a step over some keys
runs it with its parameter group narrowed to those chunks, so the keys of one message cost
one optimizer call (one foreach kernel per state tensor where torch has one), never a pass
over the others. The call skips the wrapper torch puts around every `step` (profiler
record_function, step hooks, grad-mode switch): it runs the optimizer's own step under
no_grad, which is what the wrapper does for an optimizer that is not differentiable (a
shard's optimizer has no hooks). For SGD over 4 small keys that took one call from 133 us
to 22 us on a loaded 2-core machine, against 370 us for one optimizer per key.

Checkpoints keep one state dict per key, as a one-chunk optimizer would write it.
"""

from __future__ import annotations

import inspect
import sys
from collections import defaultdict
from typing import Any, Callable

import torch

import ps.shard.compiled as compiled
from ps.protocol_state import STATE_SLOTS
from ps.shard.sgd import sgd_ops
from ps.shard.slices import SlicePool

SETUP_METHODS = ("add_param_group", "state_dict", "load_state_dict", "zero_grad")
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)
"""Optimizers whose step over a key is elementwise, beside a scalar step count: a slice's
update, with its slices of the key's state, is the whole key's bit for bit."""


def skip_compile_guards() -> None:
    """torch.optim.Optimizer's setup methods are wrapped so that torch.compile leaves them
    alone, and the wrapper imports torch._dynamo on its first call: 0.8 s here, as long as
    importing torch, paid by every shard before it can answer. A shard never compiles, and
    its steps skip the wrappers anyway (see step): resolve each wrapper to its own function.
    A no-op once torch._dynamo is loaded, or where torch wraps them otherwise."""
    if "torch._dynamo" in sys.modules:
        return
    for name in SETUP_METHODS:
        method = getattr(torch.optim.Optimizer, name, None)
        inner = getattr(method, "__wrapped__", None)
        code = getattr(method, "__code__", None)
        if inner is not None and code is not None and code.co_filename.endswith(("torch/_compile.py", "torch\\_compile.py")):
            setattr(inner, "__dynamo_disable", inner)


def replays_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of optimizer (over CPU tensors) is torch's single-tensor SGD loop, which
    sgd_step replays: torch.optim.SGD itself, neither fused, foreach nor differentiable."""
    group = optimizer.param_groups[0]
    return (type(optimizer) is torch.optim.SGD and not group.get("fused") and not group.get("foreach")
            and not group.get("differentiable"))


Fused = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", tuple, int], bool]
"""The compiled kernel (ps.shard.compiled.fused_sgd): sgd_ops on p, grad and buf with the
gradient divided first, in one pass over the memory; False where it does not take them."""


def sgd_step(state: dict, group: dict, params: list[torch.Tensor], slices: SlicePool | None = None,
             grads: list[torch.Tensor] | None = None, divisors: list[int] | None = None,
             fused: Fused | None = None) -> None:
    """torch.optim.SGD's step (its single-tensor loop, torch/optim/sgd.py) over params, op for
    op, so the same bits; without its per-call setup, which costs a small key more than the
    update (8 of 10 us for 1 KiB). The momentum buffers live in the optimizer's state, as
    torch keeps them (checkpoints are unchanged). With slices, a large dense key is updated
    in slices on the pool's threads (ps.shard.slices), the same ops on each, where the compiled
    kernel does not take it whole (it splits a large key over threads of its own). grads: each
    param's gradient, in their order (None: each param's .grad). divisors: each gradient is
    first divided by its own (torch's div_: a sync step's sum of pushes becomes their mean).
    fused: the compiled kernel, which does all of that in one pass where it can, leaving the
    gradient as it was (torch's ops divide it in place: afterwards it holds either)."""
    h = (group["lr"], group["weight_decay"], group["maximize"], group["momentum"], group["dampening"],
         group["nesterov"])
    for i, p in enumerate(params):
        grad = p.grad if grads is None else grads[i]
        if grad is None:
            continue
        divisor = 1 if divisors is None else divisors[i]
        buf = state[p].get("momentum_buffer") if h[3] != 0 else None
        if fused is not None and fused(p, grad, buf, h, divisor):
            continue  # a large key split over the compiled kernel's own threads (ps/shard/_split.h)
        cuts = slices.cuts(p.numel(), p.element_size()) if slices is not None else None
        if cuts is not None and len(cuts) > 2 and _flat(p, grad):
            _sgd_slices(state, h, p, grad, slices, cuts, divisor, fused)
            continue
        made = _sgd(p, grad, buf, h, divisor)
        if made is not buf:  # a first momentum buffer
            state[p]["momentum_buffer"] = made


def _sgd(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, h: tuple, divisor: int = 1,
         fused: Fused | None = None, fill: bool = False):
    """sgd_ops with the gradient divided by divisor first: the compiled kernel where it takes
    them, else torch's ops. Returns the momentum buffer."""
    if fused is not None and not fill and fused(p, grad, buf, h, divisor):
        return buf
    if divisor != 1:
        grad = grad.div_(divisor)
    return sgd_ops(p, grad, buf, h, fill)


def compiled_sgd() -> Fused | None:
    """The compiled kernel where it is built and rounds as torch does (ps.shard.compiled); None."""
    return compiled.fused_sgd if compiled.available() and compiled.arithmetic_matches() else None


def _flat(p: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether p and its gradient are one dense run of elements each, alike (a key to slice)."""
    return (p.dim() == 1 and grad.layout == torch.strided and grad.shape == p.shape and grad.dtype == p.dtype
            and p.is_contiguous() and grad.is_contiguous())


def _sgd_slices(state: dict, h: tuple, p: torch.Tensor, grad: torch.Tensor, slices: SlicePool,
                cuts: list[int], divisor: int = 1, fused: Fused | None = None) -> None:
    """_sgd on each slice of one key, on a thread of its own: elementwise, so the whole
    key's bits. A first momentum buffer is made whole, filled slice by slice, and kept once
    every slice has filled it."""
    values, buf = p.detach(), state[p].get("momentum_buffer") if h[3] != 0 else None
    fresh = h[3] != 0 and buf is None
    if fresh:
        buf = torch.empty_like(grad)
    slices.run(lambda a, b: _sgd(values[a:b], grad[a:b], None if buf is None else buf[a:b], h, divisor, fused,
                                 fresh), cuts)
    if fresh:
        state[p]["momentum_buffer"] = buf


def _slices_with(chunk: torch.Tensor, name: str, value: Any) -> bool:
    """Whether a state entry slices with its key: a tensor shaped as the key (dense, in one run)
    or a 0-d tensor, under a name the shards know (ps.protocol_state.STATE_SLOTS)."""
    kind = STATE_SLOTS.get(name)
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return False
    if kind == "scalar":
        return value.dim() == 0
    return kind == "key" and value.shape == chunk.shape and value.dtype == chunk.dtype and value.is_contiguous()


class ShardOptimizer:
    def __init__(self, make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                 chunks: dict[int, torch.Tensor]) -> None:
        self.keys = list(chunks)
        self.chunks = chunks
        skip_compile_guards()
        self.optimizer = make_optimizer(list(chunks.values()))
        if len(self.optimizer.param_groups) != 1:
            raise ValueError(f"a shard's optimizer must have one parameter group, "
                             f"got {len(self.optimizer.param_groups)}")
        self._group = self.optimizer.param_groups[0]
        self._all = self._group["params"]
        # torch picks its single-tensor loop for CPU tensors when foreach is unset; saying so
        # saves the per-step look at every tensor's device (the same arithmetic).
        on_cpu = all(c.device.type == "cpu" for c in chunks.values())
        self._loop = {"foreach": False} if on_cpu and self._group.get("foreach", False) is None else {}
        differentiable = self.optimizer.defaults.get("differentiable", False)
        self._step = None if differentiable else inspect.unwrap(type(self.optimizer).step)
        self._sgd = on_cpu and replays_sgd(self.optimizer)
        self._fused = compiled_sgd() if self._sgd else None
        group = self._group
        self._elementwise = (on_cpu and type(self.optimizer) in ELEMENTWISE and self._step is not None
                             and not group.get("foreach") and not group.get("fused") and not group.get("capturable"))
        self._slices: SlicePool | None = None
        self._clones: list[torch.optim.Optimizer] = []  # one a slice: each thread steps its own

    def take_threads(self, threads: int) -> bool:
        """Update large keys on `threads` threads of the optimizer's own (ps.shard.slices), if
        its step is elementwise (SGD, whose arithmetic it runs itself; Adam, AdamW, Adagrad,
        whose step it runs on each slice): whether it does, and so whether the process may keep
        torch on one thread (torch's intra-op threads spin between kernels)."""
        if not (self._sgd or self._elementwise):
            return False
        if self._fused is not None:
            compiled.set_threads(threads)  # SGD's large keys, in C (ps/shard/_split.h)
        if self._slices is not None:
            self._slices.close()
        self._slices = SlicePool(threads) if threads > 1 else None
        return True

    @property
    def lr(self) -> float:
        return self._group["lr"]

    @property
    def replays(self) -> bool:
        """Whether a step replays torch's SGD (sgd_step), which takes gradients as they are given."""
        return self._sgd and not isinstance(self._group["lr"], torch.Tensor)

    def step(self, keys, lr: float | None = None, grads: list[torch.Tensor] | None = None,
             divisors: list[int] | None = None) -> None:
        """One optimizer step over the chunks of `keys` (their .grad set, or grads given, one a
        key shaped as its chunk, and divisors of them: only where the step replays SGD), with
        learning rate lr (None: the group's own; a given one stays the group's, as a scheduler
        leaves it)."""
        if lr is not None:
            self._group["lr"] = lr
        group = self._group
        if self.replays:
            sgd_step(self.optimizer.state, group, [self.chunks[k] for k in keys], self._slices, grads, divisors,
                     self._fused)
            return
        if grads is not None or divisors is not None:
            raise ValueError("gradients are given to a step only where it replays SGD (ShardOptimizer.replays)")
        if self._slices is not None and self._elementwise and not isinstance(group["lr"], torch.Tensor):
            keys = self._step_large(keys)
            if not keys:
                return
        group["params"] = [self.chunks[k] for k in keys]
        group.update(self._loop)
        try:
            if self._step is None:
                self.optimizer.step()
            else:
                with torch.no_grad():
                    self._step(self.optimizer)
        finally:
            group["params"] = self._all
            if self._loop:
                group["foreach"] = None

    def _step_large(self, keys) -> list:
        """Step each key of `keys` large enough to slice, whose state exists (a key's first
        step makes it, whole), in slices (_step_slices); the keys left to step whole."""
        whole = []
        for k in keys:
            chunk = self.chunks[k]
            state, grad = self.optimizer.state.get(chunk), chunk.grad
            cuts = self._slices.cuts(chunk.numel(), chunk.element_size())
            if grad is None or len(cuts) <= 2 or not state or not _flat(chunk, grad) \
                    or not all(_slices_with(chunk, name, t) for name, t in state.items()):
                whole.append(k)
            else:
                self._step_slices(chunk, grad, state, cuts)
        return whole

    def _step_slices(self, chunk: torch.Tensor, grad: torch.Tensor, state: dict, cuts: list[int]) -> None:
        """The optimizer's own step (unwrapped) over each slice of chunk, on the pool's threads,
        each with an optimizer of its own holding that slice and its slices of the state; the
        scalar state (the step count) advanced once, as the slices each advanced a copy."""
        hyper = {n: v for n, v in self._group.items() if n != "params"} | self._loop
        values, scalars = chunk.detach(), {}
        while len(self._clones) < len(cuts) - 1:
            # the optimizer's class and fields, not its __setstate__ (which would walk the live state)
            clone = object.__new__(type(self.optimizer))
            clone.__dict__.update(self.optimizer.__dict__)
            self._clones.append(clone)

        def piece(a: int, b: int) -> None:
            opt, part = self._clones[cuts.index(a)], values[a:b]
            part.grad = grad[a:b]
            opt.state = defaultdict(dict)
            opt.state[part] = {n: t[a:b] if STATE_SLOTS[n] == "key" else t.clone() for n, t in state.items()}
            opt.param_groups = [{**hyper, "params": [part]}]
            with torch.no_grad():  # a thread's own grad mode
                self._step(opt)
            if a == 0:
                scalars.update((n, t) for n, t in opt.state[part].items() if STATE_SLOTS[n] == "scalar")
            opt.state, part.grad = defaultdict(dict), None

        self._slices.run(piece, cuts)
        for name, value in scalars.items():
            state[name].copy_(value)

    def state_dict(self) -> dict[int, dict[str, Any]]:
        """{key: the state dict a one-chunk optimizer of that key would have}."""
        full = self.optimizer.state_dict()
        hyper = {n: v for n, v in full["param_groups"][0].items() if n != "params"}
        return {k: {"state": {0: full["state"][i]} if i in full["state"] else {},
                    "param_groups": [{**hyper, "params": [0]}]}
                for i, k in enumerate(self.keys)}

    def slots(self, k: int) -> list[tuple[str, torch.Tensor]]:
        """Key k's optimizer state as it travels (ps.protocol_state): copies, flat or 0-d.
        ValueError naming a slot the wire does not carry (a sparse buffer, another name)."""
        chunk, out = self.chunks[k], []
        for name, value in sorted(self.optimizer.state.get(chunk, {}).items()):
            kind = STATE_SLOTS.get(name)
            if value is None and kind == "key":  # SGD keeps momentum_buffer None without momentum
                continue
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(float(value), dtype=torch.float64)
            if kind is None or value.layout != torch.strided or value.is_sparse:
                raise ValueError(f"key {k}'s optimizer state {name!r} ({type(value).__name__}, {value.layout}) "
                                 f"cannot travel; the shards send {sorted(STATE_SLOTS)} as dense tensors")
            if kind == "key" and (value.numel() != chunk.numel() or value.dtype != chunk.dtype):
                raise ValueError(f"key {k}'s optimizer state {name!r} is {value.dtype} of {value.numel()} elements, "
                                 f"the key {chunk.dtype} of {chunk.numel()}")
            if kind == "scalar" and value.numel() != 1:
                raise ValueError(f"key {k}'s optimizer state {name!r} has {value.numel()} elements; expected one")
            out.append((name, value.detach().reshape(-1 if kind == "key" else ()).clone()))
        return out

    def load_slots(self, states: dict[int, list[tuple[str, torch.Tensor]]]) -> None:
        """Replace the optimizer state of every key by states {key: [(slot, tensor)]} (as
        slots() gives it; a key with none starts afresh), as torch's load_state_dict does."""
        if set(states) != set(self.keys):
            raise ValueError(f"optimizer state given for keys {sorted(states)[:8]}, this shard has {self.keys[:8]}")
        for k in self.keys:
            chunk = self.chunks[k]
            self.optimizer.state.pop(chunk, None)
            if states[k]:
                self.optimizer.state[chunk] = {name: t.reshape(chunk.shape if STATE_SLOTS[name] == "key" else ()).clone()
                                               for name, t in states[k]}

    def load_state_dict(self, saved: dict[int, dict[str, Any]]) -> None:
        if set(saved) != set(self.keys):
            raise ValueError(f"checkpoint holds optimizer state of keys {sorted(saved)[:8]}, this shard has "
                             f"keys {sorted(self.keys)[:8]}")
        groups = [saved[k]["param_groups"] for k in self.keys]
        if any(len(g) != 1 for g in groups):
            raise ValueError("checkpoint's optimizer state has more than one parameter group for a key")
        hyper = {n: v for n, v in groups[0][0].items() if n != "params"} if groups else {}
        state = {i: s for i, k in enumerate(self.keys) for s in saved[k]["state"].values()}
        self.optimizer.load_state_dict({"state": state,
                                        "param_groups": [{**hyper, "params": list(range(len(self.keys)))}]})
        # torch puts a new dict in param_groups: a push's lr and every step read that one
        self._group = self.optimizer.param_groups[0]
        self._all = self._group["params"]
