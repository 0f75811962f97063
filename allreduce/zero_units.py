"""ZeRO stage 3: the parameters themselves sharded, each unit gathered just before it is used.

A unit is a module that holds trained parameters of its own (a Linear, a LayerNorm, an
Embedding); a parameter two modules share (a token embedding tied to the output head) belongs
to the first and is gathered for both. A unit's full values live in one padded buffer whose
storage is allocated only while the unit is gathered: its forward pre-hook gathers it (an
all-gather of every rank's piece) and starts gathering the unit that ran next in the last
forward; once every module using it has run forward its storage is freed. A hook on the
module's output gathers it again when backward reaches the module, and once all its
parameters have their gradient it is reduce-scattered (as stage 2 does) and freed again: the
all-gather twice and the reduce-scatter once, 3(N-1)/N of the model's bytes a step. The
parameters stay views of the buffer throughout, so autograd's saved tensors find their values
again once the storage is back. After close every unit stays gathered (model.pt, eval).

A mixin of allreduce.zero.ZeroEngine, whose fields and methods it uses: buckets, world, rank,
memory, _bytes, _waited, _collectives, _make_bucket.
"""

from __future__ import annotations

import time

import torch

from .zero_buckets import nbytes


class Units:
    def _attach_units(self, model: torch.nn.Module) -> None:
        """One bucket per unit, in reverse module order (the order backward reaches them);
        hooks on every module that uses a unit's parameters; every unit freed."""
        owner: dict[int, int] = {}
        units = []
        for prefix, module in model.named_modules():
            mine = [(f"{prefix}.{n}" if prefix else n, p) for n, p in module.named_parameters(recurse=False)
                    if p.requires_grad and id(p) not in owner]
            for _, p in mine:
                owner[id(p)] = len(units)
            if mine:
                units.append(mine)
        last = len(units) - 1
        self.buckets = [self._make_bucket(named, sharded=True) for named in reversed(units)]
        self._uses: dict[torch.nn.Module, list[int]] = {}
        for module in model.modules():
            used = sorted({last - owner[id(p)] for p in module.parameters(recurse=False) if id(p) in owner})
            if used:
                self._uses[module] = used
        self._users = {b: sum(b in used for used in self._uses.values()) for b in range(len(self.buckets))}
        self._done: dict[int, int] = {}  # forwards finished this step, per unit
        # the last forward's order of units: each one's next, and previous (prefetch targets)
        self._following: dict[int, int] = {}
        self._preceding: dict[int, int] = {}
        self._seen: dict[int, None] = {}  # this forward's units, in order
        self._unit_hooks = []
        for module in self._uses:
            self._unit_hooks.append(module.register_forward_pre_hook(self._before_forward))
            self._unit_hooks.append(module.register_forward_hook(self._after_forward))
        for b in range(len(self.buckets)):
            self._free(b)

    def _gather(self, b: int) -> None:
        """Start gathering unit b's values (nothing if it is gathered or on its way)."""
        bucket = self.buckets[b]
        if bucket.gathered:
            return
        bucket.values.untyped_storage().resize_(nbytes(bucket.values))
        bucket.gathering = self._collectives.all_gather(bucket.values, bucket.piece.detach())
        bucket.gathered = True
        self._bytes += nbytes(bucket.values) * (self.world - 1) // self.world
        held = sum(nbytes(x.values) for x in self.buckets if x.gathered) + sum(nbytes(x.piece) for x in self.buckets)
        self.memory["params"] = max(self.memory["params"], held)

    def _ready(self, b: int) -> None:
        """Unit b gathered and its values in."""
        self._gather(b)
        bucket = self.buckets[b]
        if bucket.gathering is not None:
            began = time.perf_counter()
            bucket.gathering.wait()
            bucket.gathering = None
            self._waited += time.perf_counter() - began  # the step's communication, not its compute

    def _free(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.gathering is not None:
            bucket.gathering.wait()
            bucket.gathering = None
        bucket.values.untyped_storage().resize_(0)
        bucket.gathered = False

    def _before_forward(self, module: torch.nn.Module, _args) -> None:
        for b in self._uses[module]:
            self._seen.setdefault(b)
            self._ready(b)
        following = self._following.get(self._uses[module][-1])
        if following is not None:
            self._gather(following)

    def _after_forward(self, module: torch.nn.Module, _args, output):
        for b in self._uses[module]:
            self._done[b] = self._done.get(b, 0) + 1
            if self._done[b] == self._users[b] and torch.is_grad_enabled():
                self._free(b)
        if torch.is_grad_enabled():
            uses = self._uses[module]
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, uses=uses: self._before_backward(uses))
        return output

    def _before_backward(self, uses: list[int]) -> None:
        """Backward reached a module: its units gathered again, the one backward reaches next on
        its way."""
        for b in uses:
            self._ready(b)
        earlier = self._preceding.get(uses[0])
        if earlier is not None:
            self._gather(earlier)

    def _start_backward(self) -> None:
        """The forward is over: its order is the next one's prefetch order."""
        if self._seen:
            order, self._seen = list(self._seen), {}
            self._following = dict(zip(order, order[1:]))
            self._preceding = dict(zip(order[1:], order))
        self._done = {}

    def _gather_all(self) -> None:
        """Every unit gathered for good (after the run: model.pt, eval)."""
        for hook in self._unit_hooks:
            hook.remove()
        self._unit_hooks = []
        for b in range(len(self.buckets)):
            self._ready(b)


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []

