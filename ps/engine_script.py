"""What a user's script does between backward and step, on the parameter-server engine:
clipping by the global norm on the shards (ps-sync holds each step's update for it), the
learning rate of its schedule, and refusals by name of what the shards would never see. A
mixin of ps.engine.PSEngine, whose fields it reads: mode, config, client, clip_mode,
schedule, _named, _tables, _deferred, _pushed_grads, _hyper, _scale, _marks."""

from __future__ import annotations

import math

import torch


class ScriptSteps:
    def allow_clip(self) -> None:
        """A script's run: clip_grad_norm_ may come. Its first step's pushes wait until the
        script either clips or steps (then every step is as without this)."""
        if self.mode == "sync" and not self._tables:
            self.clip_mode = None

    def _release_deferred(self, clip: bool) -> None:
        self.clip_mode = clip
        deferred, self._deferred = self._deferred, []
        for index in deferred:
            self._enqueue(index, self._named[index][1])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the step's averaged gradient by its global norm, as torch's clip_grad_norm_
        under DDP: the shards hold the update, each gives the sum of squares of its part, and
        every worker sends the same coefficient with its pull. Returns the norm."""
        if self.config.downpour:
            raise NotImplementedError("job.clip_grad_norm_ with ps.push_every or ps.fetch_every above 1: the "
                                      "workers step on their own gradients between pushes")
        if self.mode != "sync":
            raise NotImplementedError(f"job.clip_grad_norm_ under ps-{self.mode}: each push is applied on "
                                      f"arrival, so there is no averaged gradient to clip; use ps-sync")
        if self.config.backup_workers:
            raise NotImplementedError(f"job.clip_grad_norm_ with ps.backup_workers={self.config.backup_workers}: "
                                      "a step's late pushes are dropped, so no worker knows the averaged "
                                      "gradient's norm before the update")
        if self._tables:
            raise NotImplementedError("job.clip_grad_norm_ with row-sparse tables on the shards: their rows "
                                      "are not held for a clip; set ps.sparse=dense")
        if norm_type != 2.0:
            raise NotImplementedError(f"job.clip_grad_norm_ with norm_type={norm_type}: the shards clip by the 2-norm")
        if self.clip_mode is False:
            raise RuntimeError("job.clip_grad_norm_ after steps without it: under ps-sync a script clips "
                               "from its first step on (the shards hold each step's update for it)")
        if self.clip_mode is None:
            self._release_deferred(True)
        self._flush(None)
        sums = self.client.wait(self.client.norm()).sq
        total = math.sqrt(sum(sums[s] for s in sorted(sums)))
        self._scale = min(1.0, max_norm / (total + 1e-6))
        return torch.tensor(total, dtype=torch.float64)

    @property
    def _watches_values(self) -> bool:
        """A script's run whose parameters are the shards' and loaded in step(): a change the
        script makes to them between steps would be lost (nothing to watch otherwise)."""
        return self.schedule is not None and self.values_on_shards and self._forward is None

    def _mark_values(self) -> None:
        """The parameters now hold the shards' values (after attach, and each step of a run
        that watches them)."""
        self._marks = [p._version for _, p in self._named]

    def _check_values(self) -> None:
        """A script that changed the parameters since (loaded a model after attach, or edited
        them after a step) is refused before its gradients leave: the shards keep their own
        values, so the change would be lost at the next step."""
        if not self._watches_values:
            return
        changed = [name for i, ((name, p), mark) in enumerate(zip(self._named, self._marks))
                   if p._version != mark and i not in self._tables]
        if changed:
            shown = ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
            raise RuntimeError(f"the values of {shown} changed after job.attach() or job.step() (model.load_state_dict, "
                               f"or an edit of the parameters): under ps-{self.mode} the shards hold the parameters and "
                               f"would overwrite them. Load a model before job.attach(), which gives it to the shards")

    def _lr(self) -> float | None:
        """The learning rate of the script's schedule for this step (None without one)."""
        return None if self.schedule is None else float(self.schedule.param_groups[0]["lr"])

    def _check_script(self) -> None:
        """What a script did between backward and step that the shards would never see:
        refused by name, never silently lost."""
        changed = [self._named[i][0] for i, (grad, version) in self._pushed_grads.items()
                   if self._named[i][1].grad is not grad or grad._version != version]
        self._pushed_grads = {}
        if changed:
            shown = ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
            raise RuntimeError(
                f"the gradient of {shown} changed after backward pushed it to the shards (by "
                f"torch.nn.utils.clip_grad_norm_, or another edit between job.backward() and job.step()): "
                f"under ps-{self.mode} each gradient leaves during backward, so the change would be lost. "
                f"Clip with job.clip_grad_norm_(max_norm): it clips the averaged gradient by its global "
                f"norm on every synchronous engine (under ps-sync the shards agree on the norm)")
        if self.schedule is None:
            return
        groups = self.schedule.param_groups
        hyper = {k: v for k, v in groups[0].items() if k not in ("params", "lr", "initial_lr")}
        if self._hyper is None:
            self._hyper = hyper
        moved = sorted(k for k in hyper if hyper[k] != self._hyper.get(k))
        if len(groups) != 1 or moved:
            what = f"{len(groups)} parameter groups" if len(groups) != 1 else f"its {', '.join(moved)}"
            raise RuntimeError(f"job.optimizer changed {what}: under ps-{self.mode} the optimizer runs on the "
                               f"shards, which take only the learning rate from a schedule (one group)")
