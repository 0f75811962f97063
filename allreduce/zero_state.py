"""The engine zero's checkpoint in torch's layout: the optimizer state of every parameter, put
together from the ranks' pieces, and a file's state cut back into them.

Each rank's optimizer steps its pieces (one per bucket), so the state it holds is of those. A
checkpoint must be the file the same optimizer writes under allreduce or ddp, keyed by the
model's trained parameters in their order, so that every engine (and torch itself) loads it.
As torch's ZeroRedundancyOptimizer asks, every rank calls job.optimizer.consolidate_state_dict(to),
which all-gathers each bucket's state slot by slot; rank `to` (every rank with to=None: the
runs' own checkpoints, one file per rank) then gets it from state_dict() until the next step,
and another rank gets a RuntimeError naming the call. Under stage 3 it also gathers every unit,
so that model.state_dict() holds the values until the next forward frees them (and refuses by
name before). load_state_dict(), on every rank, takes a file in torch's layout and keeps
each rank's pieces of it.

A mixin of allreduce.zero.ZeroEngine, whose fields and methods it uses: buckets, world, rank,
config, optimizer, memory, _bytes, _waited, _collectives, _liveness, _ready.
"""

from __future__ import annotations

import torch

NOT_CONSOLIDATED = ("under zero each rank's optimizer holds the state of its own pieces: call "
                    "job.optimizer.consolidate_state_dict(to=RANK) on every rank first, as torch's "
                    "ZeroRedundancyOptimizer asks; state_dict() on RANK is then the whole state, until the next step")


class ZeroState:
    def _keep_torchs_layout(self, model: torch.nn.Module) -> None:
        """Give job.optimizer consolidate_state_dict and torch's layout in and out."""
        self._trained = [p for p in model.parameters() if p.requires_grad]  # the layout's indices
        self._consolidated: dict | None = None
        if [g["params"] for g in self.optimizer.param_groups] != [[b.piece for b in self.buckets]]:
            raise RuntimeError("under zero make_optimizer must put every parameter it is given in one group")
        self.optimizer.consolidate_state_dict = self.consolidate_state_dict
        self.optimizer.register_state_dict_post_hook(self._whole_state)
        self.optimizer.register_load_state_dict_pre_hook(self._own_pieces)
        if self.config.stage == 3:
            model.register_state_dict_pre_hook(self._refuse_freed)

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """On every rank: rank `to` (every rank if None) gets the whole optimizer state from
        state_dict(); under stage 3 every rank gets every parameter's values. Neither counts in
        the step's bytes or the memory peaks (a checkpoint's, not training's)."""
        if to is not None and not 0 <= to < self.world:
            raise ValueError(f"consolidate_state_dict(to={to}): a rank of 0..{self.world - 1}, or None for every rank")
        kept = dict(self.memory), self._bytes, self._waited
        with self._liveness.naming_lost_ranks():
            whole = self._gathered_state()
            if self.config.stage == 3:  # until the next forward, which finds them gathered
                for b in range(len(self.buckets)):
                    self._ready(b)
        self.memory, self._bytes, self._waited = kept
        self._consolidated = whole if to is None or to == self.rank else None

    def _gathered_state(self) -> dict[int, dict]:
        """Every trained parameter's state, by its index, from every rank's pieces."""
        index = {id(p): i for i, p in enumerate(self._trained)}
        whole: dict[int, dict] = {}
        for bucket in self.buckets:
            piece = bucket.piece
            for slot, value in sorted(self.optimizer.state.get(piece, {}).items()):
                if not isinstance(value, torch.Tensor) or value.shape != piece.shape:
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        raise NotImplementedError(f"the optimizer's {slot!r} is of shape {tuple(value.shape)}, not "
                                                  "one value per parameter nor one number: zero cannot put it together")
                    for p in bucket.params:
                        whole.setdefault(index[id(p)], {})[slot] = value.clone() if isinstance(value, torch.Tensor) else value
                    continue
                flat = torch.empty(piece.numel() * self.world, dtype=value.dtype, device=value.device)
                self._collectives.all_gather(flat, value.detach().contiguous()).wait()  # each piece where it goes
                for p, offset in zip(bucket.params, bucket.offsets):
                    whole.setdefault(index[id(p)], {})[slot] = flat[offset: offset + p.numel()].view(p.shape).clone()
        return whole

    def _whole_state(self, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
        """state_dict()'s post-hook: the consolidated state, in torch's layout."""
        if self._consolidated is None:
            raise RuntimeError(NOT_CONSOLIDATED)
        group = saved["param_groups"][0]
        return {"state": {i: dict(entry) for i, entry in sorted(self._consolidated.items())},
                "param_groups": [{**group, "params": list(range(len(self._trained)))}]}

    def _own_pieces(self, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
        """load_state_dict()'s pre-hook: a file in torch's layout, as this rank's pieces."""
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1:
            raise ValueError(f"the optimizer state to load has {len(groups) if isinstance(groups, list) else 'no'} "
                             "parameter groups; under zero the optimizer has one")
        packed = groups[0].get("params", [])
        if len(packed) != len(self._trained):
            raise ValueError(f"the optimizer state to load is of {len(packed)} parameters; the model trains "
                             f"{len(self._trained)}")
        entries = saved.get("state", {})
        per_param = {id(p): entries.get(key, {}) for p, key in zip(self._trained, packed)}
        state = {}
        for b, bucket in enumerate(self.buckets):
            pieces = self._cut(bucket, [per_param[id(p)] for p in bucket.params])
            if pieces:
                state[b] = pieces
        return {"state": state, "param_groups": [{**groups[0], "params": list(range(len(self.buckets)))}]}

    def _cut(self, bucket, entries: list[dict]) -> dict:
        """A bucket's parameters' state from a file, as this rank's piece keeps it."""
        names = [sorted(e) for e in entries]
        if any(n != names[0] for n in names[1:]):
            differ = sorted({(bucket.names[i], tuple(n)) for i, n in enumerate(names)})
            raise ValueError(f"the optimizer state to load has different slots for parameters zero steps "
                             f"together: {differ}")
        piece, own = {}, self._collectives.owner
        size = bucket.piece.numel()
        for slot in names[0]:
            values = [e[slot] for e in entries]
            if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, bucket.params)) \
                    and not (slot == "step" and all(p.dim() == 0 for p in bucket.params)):
                flat = torch.zeros(size * self.world, dtype=bucket.piece.dtype, device=bucket.piece.device)
                for v, p, offset in zip(values, bucket.params, bucket.offsets):
                    flat[offset: offset + p.numel()].copy_(v.reshape(-1))
                piece[slot] = flat[own * size: (own + 1) * size].clone()
                continue
            numbers = {float(v) for v in values if not isinstance(v, torch.Tensor) or v.numel() == 1}
            if len(numbers) != 1 or any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
                shown = ", ".join(f"{n}: {tuple(v.shape) if isinstance(v, torch.Tensor) else v}"
                                  for n, v in zip(bucket.names, values))
                raise ValueError(f"the optimizer state to load has {slot!r} neither shaped like each parameter nor "
                                 f"one number for all: {shown}")
            piece[slot] = values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]
        return piece

    def _refuse_freed(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        if not all(b.gathered for b in self.buckets):
            raise RuntimeError("model.state_dict() under zero.stage=3 between steps: each rank holds a piece of "
                               "every parameter; call job.optimizer.consolidate_state_dict(to=0) on every rank "
                               "first, which gathers them until the next forward")
