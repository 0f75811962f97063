"""A script's own checkpoint under the parameter servers: job.optimizer's state_dict() and
load_state_dict() in torch's layout, with the state itself on the shards.

torch's optimizer keeps, per parameter, its state tensors (shaped like the parameter) and
scalars (Adam's step); the shards keep the same per key, a key being a chunk of a parameter
(ps.layout). state_dict() asks every shard for its keys' state and puts each parameter's
together, so the file is the one the same optimizer writes under allreduce or ddp, and loads
under any engine; load_state_dict() cuts each parameter's state into its keys and worker 0
sends every shard its own, which replace theirs (the other workers check the file alike and
send nothing). A mixin of ps.engine.PSEngine, whose fields it reads: client, layout, config,
mode, world, rank, _named, _optimizer, _hyper, schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from ps.protocol_state import STATE_SLOTS

IMPLEMENTATION = frozenset(("params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"))
"""A parameter group's entries that are not the optimizer's settings: where the shards run
them, they are the shards' own (lr comes with each push)."""


def settings_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings of the optimizer's one group, as the shards run them (no lr)."""
    return {k: v for k, v in optimizer.param_groups[0].items() if k not in ("params", "lr", "initial_lr")}


class ScriptState:
    def use_schedule(self, optimizer: torch.optim.Optimizer) -> None:
        """The script's job.optimizer: never stepped; its learning rate leaves with the pushes,
        and its state_dict() and load_state_dict() read and write the shards' state."""
        self.schedule = optimizer
        self._hyper = settings_of(optimizer)
        optimizer.register_state_dict_post_hook(self._state_from_shards)
        optimizer.register_load_state_dict_pre_hook(self._state_to_shards)
        optimizer.register_load_state_dict_post_hook(self._loaded)

    def _refuse_state(self, call: str, loading: bool) -> None:
        if self.config.downpour:
            raise NotImplementedError(f"{call} with ps.push_every or ps.fetch_every above 1: each worker steps an "
                                      "optimizer of its own between pushes, so its state is not the shards' alone")
        if loading and self.mode != "sync" and self.world > 1:
            raise NotImplementedError(f"{call} under ps-{self.mode} with {self.world} workers: the other workers' "
                                      "pushes may be applied before the state arrives; load it under ps-sync or "
                                      "with one worker, or resume with psar launch --resume (checkpoint.every), "
                                      "which restores the shards themselves")
        if loading and self.config.backup_workers:
            raise NotImplementedError(f"{call} with ps.backup_workers={self.config.backup_workers}: a step may "
                                      "update without worker 0's push, before the state arrives")

    def _positions(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """Per parameter of the optimizer's group, in its order: its index in _named."""
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        params = optimizer.param_groups[0]["params"]
        missing = [n for n, p in enumerate(params) if id(p) not in index]
        if len(optimizer.param_groups) != 1 or missing or len(params) != len(self._named):
            raise RuntimeError("job.optimizer must hold the model's trained parameters, in one group, as "
                               "make_optimizer built it")
        return [index[id(p)] for p in params]

    def _state_from_shards(self, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
        """state_dict()'s post-hook: the state is each parameter's, put together from the shards'."""
        self._refuse_state("job.optimizer.state_dict()", loading=False)
        per_key = self.client.optimizer_state()
        state = {}
        for packed, i in zip(saved["param_groups"][0]["params"], self._positions(optimizer)):
            entry = self._gathered(i, per_key)
            if entry:
                state[packed] = entry
        return {**saved, "state": state}

    def _gathered(self, i: int, per_key: dict[int, list]) -> dict[str, torch.Tensor]:
        name, param = self._named[i]
        slots = [dict(per_key[k.id]) for k in self.layout.param_keys(i)]
        names = list(slots[0])
        if any(list(s) != names for s in slots[1:]):
            raise RuntimeError(f"the shards keep different optimizer state for the parts of {name}: "
                               f"{sorted({tuple(s) for s in slots})}")
        entry = {}
        for slot in names:
            if STATE_SLOTS[slot] == "key":
                entry[slot] = torch.cat([s[slot] for s in slots]).view(param.shape).to(param.device)
                continue
            values = {float(s[slot]) for s in slots}
            if len(values) != 1:
                raise RuntimeError(f"the shards' optimizer {slot!r} differs between the parts of {name}: {sorted(values)}")
            entry[slot] = slots[0][slot].clone()
        return entry

    def _state_to_shards(self, optimizer: torch.optim.Optimizer, saved: dict) -> dict:
        """load_state_dict()'s pre-hook: the file's state goes to the shards (from worker 0);
        the optimizer here takes its groups (the learning rate) and keeps no state."""
        self._refuse_state("job.optimizer.load_state_dict()", loading=True)
        groups = saved.get("param_groups")
        if not isinstance(groups, list) or len(groups) != 1:
            raise ValueError(f"the optimizer state to load has {len(groups) if isinstance(groups, list) else 'no'} "
                             "parameter groups; the shards run one")
        packed, positions = groups[0].get("params", []), self._positions(optimizer)
        if len(packed) != len(positions):
            raise ValueError(f"the optimizer state to load is of {len(packed)} parameters; the model trains "
                             f"{len(positions)}")
        differ = sorted(k for k in groups[0] if k not in IMPLEMENTATION and k in self._hyper
                        and groups[0][k] != self._hyper[k])
        if differ:
            shown = ", ".join(f"{k}={groups[0][k]!r} (the shards run {self._hyper[k]!r})" for k in differ)
            raise ValueError(f"the optimizer state to load has {shown}: the shards run make_optimizer's settings; "
                             "build it with the checkpoint's")
        states, mine = {}, {}
        for p_id, i in zip(packed, positions):
            slots = self._slots(i, saved.get("state", {}).get(p_id, {}))
            mine[i] = {n: t.view(self._named[i][1].shape) if STATE_SLOTS[n] == "key" else t for n, t in slots}
            for key in self.layout.param_keys(i):
                states[key.id] = [(n, t[key.offset: key.offset + key.numel] if STATE_SLOTS[n] == "key" else t)
                                  for n, t in slots]
        if self.rank == 0:
            self.client.load_optimizer_state(states)
        if self._optimizer is not None:  # compressed pulls: this worker's optimizer follows the shards'
            own = self._optimizer.state_dict()
            self._optimizer.load_state_dict({"state": {i: s for i, s in mine.items() if s},
                                             "param_groups": own["param_groups"]})
        return {**saved, "state": {}}

    def _slots(self, i: int, entry: dict) -> list[tuple[str, torch.Tensor]]:
        """A parameter's state from the file, as the shards keep it: flat in its dtype, or 0-d."""
        name, param = self._named[i]
        out = []
        for slot, value in entry.items():
            kind = STATE_SLOTS.get(slot)
            if kind is None:
                raise ValueError(f"the optimizer state to load has {slot!r} for {name}; the shards keep "
                                 f"{sorted(STATE_SLOTS)}")
            if value is None:
                continue
            t = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value), dtype=torch.float64)
            if kind == "key":
                if t.numel() != param.numel():
                    raise ValueError(f"the optimizer state to load has {slot!r} of {t.numel()} elements for {name}, "
                                     f"which has {param.numel()}")
                t = t.to("cpu", param.dtype).reshape(-1).contiguous()  # as torch casts it to the parameter
            else:
                t = t.to("cpu").reshape(())
                t = t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)
            out.append((slot, t))
        return out

    def _loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After load_state_dict: the settings the next steps are checked against are the file's."""
        self._hyper = settings_of(optimizer)
