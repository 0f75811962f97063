"""The consistency rules of a shard: when a push updates the parameters, when a pull is
answered, what a version counts. One interface, three rules; the shard asks its rule and
never its mode's name.

- sync (BSP): gradients of a step are summed per key; as soon as every live worker has
  pushed a key, its grad is the mean over the workers that pushed it and the optimizer
  updates that key, and a pull waiting for it is answered at once, while other keys are
  still arriving (pushes and pulls share the link's two directions). When every key is
  updated the step is complete and the version goes up by one. The keys that become ready
  together (a bucket's) are updated in one optimizer call (ps.shard.optim); each key's update
  is what one optimizer step over all of them does to it (the optimizers here are per tensor).
  With backup workers (ps.backup_workers=b) a key is ready once the first N - b live workers
  pushed it (once every worker has joined: the first steps wait for all to be there); the
  late pushes of a step (a key already updated, or a step already done) are dropped,
  counted by step, and their pull answered with the new values. A worker that rejoins
  (a new process in a lost one's place) is counted from the next step: its join is answered
  when the step under way is done, and its pushes of steps already done are dropped.
  A step may hold its update for a clip by the global norm (see ps.protocol): the shard keeps
  the averaged gradient, answers 'norm' with its sum of squares, and the first pull with the
  clip 'scale' makes the update.
- async (Hogwild-style): every push is applied on arrival (grad scaled by 1/N under
  async_scale="mean"); the version counts completed worker-steps on this shard. Pushes of
  rows count row collisions (ps.shard.rows).
- ssp: async, and a pull with clock c waits until c - (slowest live worker's clock) <= s.

A rule works on its shard through the small Host interface below, so it is tested alone.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from ps.config import PSConfig
from ps.protocol import MODES, Message
from ps.shard.reject import Reject
from ps.shard.rows import RowCollisions, grad_of
from ps.shard.workers import Workers

HOLD_ONLY_SYNC = ("a push holds its update ('hold') only under sync, of whole keys, without 'pull': "
                  "the values come with the pull that carries the step's clip 'scale'")
HELD_STEPS_KEPT = 4
"""Held steps whose clip scale and sum of squares are kept, for workers that read them late."""


class Host(Protocol):
    """What a rule uses of its shard."""

    version: int
    keys: list[int]
    chunks: dict[int, torch.Tensor]  # key -> flat, or (rows, dim)
    workers: Workers
    config: PSConfig
    counters: dict[str, int]  # a rule counts "updates", "row_collisions" and "dropped_keys"

    def apply(self, keys: Sequence[int], label: Callable[[], str] | str, count: bool = True,
              lr: float | None = None, *, grads: Sequence[torch.Tensor], divisors: list[int] | None = None) -> None:
        """One optimizer step over the chunks of keys with grads, one a key, each shaped as its
        chunk, each divided by its divisor first where given (label: what a trace calls it, or
        a function that says, called only where there is a trace)."""

    def bump(self) -> None:
        """The version goes up by one."""


class Rule:
    """The interface, and what async and sync share. name: the mode's name; versions_per_step:
    how many versions one step of every worker makes (for checkpoint periods)."""

    name = ""
    readied: set[int] | None = None
    """What the last push changed that a waiting request may wait for: the keys it made ready
    within a step (sync; empty: nothing, no request can go on), or None: anything (a new
    version, every async push). ShardServer._release asks the waiting requests accordingly."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.dropped: dict[int, set[int]] = {}  # step -> workers with a push of it dropped (backup workers)

    @property
    def versions_per_step(self) -> int:
        return 1

    # -- pushes --------------------------------------------------------------------------------

    def check_step(self, w: int, step: int) -> None:
        """Refuse (Reject) a push of step that the rule cannot take now."""

    def check_push(self, w: int, step: int, msg: Message) -> None:
        """Refuse (Reject) a push's 'hold' and 'lr' where the rule cannot take them."""
        if msg.get("hold"):
            raise Reject(HOLD_ONLY_SYNC)

    def push(self, w: int, step: int, keys: list[int], grads: list[torch.Tensor],
             ids: list[torch.Tensor | None], lr: float | None, hold: bool) -> None:
        """Take a validated push: update now, or once the rule says so."""
        raise NotImplementedError

    # -- pulls ---------------------------------------------------------------------------------

    def version_of(self, keys: Sequence[int]) -> int:
        """The version the values of keys are at."""
        return self.host.version

    def pull_ready(self, msg: Message) -> bool:
        """The rule's own condition on a pull (beyond min_version and wait_left)."""
        return True

    def over(self) -> bool:
        """No step will come any more: a pull waiting for one is answered with what there is."""
        return False

    def pull_waits_for(self, msg: Message) -> str | None:
        """What a pull that is not ready waits for, by the rule's own condition; None: nothing."""
        return None

    def read(self, w: int) -> None:
        """Worker w is sent the current values."""

    # -- held steps (a clip by the global norm) --------------------------------------------------

    def check_norm(self) -> None:
        raise Reject("'norm' is for sync steps that hold their update")

    def norm_ready(self, step: int) -> bool:
        return False

    def norm_of(self, step: int) -> float:
        raise KeyError(step)

    def norm_waits_for(self, step: int) -> str:
        return f"every key of held step {step}"

    def scale(self, msg: Message) -> None:
        """A pull carries the held step's clip scale."""
        raise Reject("a clip 'scale' is for sync steps that hold their update")

    # -- workers ---------------------------------------------------------------------------------

    def worker_gone(self) -> None:
        """A worker left or was dropped: what waited for it may go on."""

    def rejoin(self, w: int) -> bool:
        """A new process in worker w's place joined (Workers.rejoin done): whether its join is
        answered now (False: once Workers.joining no longer holds it)."""
        return True

    def joined(self, w: int) -> None:
        """Worker w joined: what waited for every worker to be there may go on."""


class AsyncRule(Rule):
    """Every push is applied on arrival; a version is one worker-step on this shard."""

    name = "async"

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.rows = RowCollisions(host.chunks)

    @property
    def versions_per_step(self) -> int:
        return len(self.host.workers.ids)

    def push(self, w, step, keys, grads, ids, lr, hold) -> None:
        host = self.host
        live = len(host.workers.ids) - len(host.workers.lost)
        scale = 1.0 / live if host.config.async_scale == "mean" else 1.0
        given = []  # the gradients as the chunks are shaped (grad_of); optimizers only read them
        for k, g, i in zip(keys, grads, ids):
            g = g * scale if scale != 1.0 else g
            if i is not None:
                host.counters["row_collisions"] += self.rows.count(k, w, i, host.counters["updates"] + 1)
            given.append(grad_of(host.chunks[k].shape, g, i))
        host.apply(keys, lambda: f"apply push of worker {w} (step {step})", lr=lr, grads=given)
        if host.workers.note_keys(w, step, keys):
            host.bump()

    def read(self, w: int) -> None:
        self.rows.read(w, self.host.counters["updates"])

    def rejoin(self, w: int) -> bool:
        """It goes on from the slowest other live worker's clock (its own if later), so that
        under ssp nobody waits for it to redo the clocks it missed."""
        workers = self.host.workers
        others = [workers.clocks[o] for o in workers.live() if o != w]
        workers.clocks[w] = max([workers.clocks[w]] + ([min(others)] if others else []))
        return True


class SSPRule(AsyncRule):
    """Async, and a pull with clock c waits until c - (slowest live worker's clock) <= staleness."""

    name = "ssp"

    def pull_ready(self, msg: Message) -> bool:
        clock, slowest = msg.get("clock"), self.host.workers.slowest()
        return clock is None or slowest is None or clock - slowest[1] <= self.host.config.staleness

    def pull_waits_for(self, msg: Message) -> str | None:
        if msg.get("clock") is None:
            return None
        slow, at = self.host.workers.slowest() or (None, None)
        return (f"clock {msg.get('clock')} to be within staleness {self.host.config.staleness} of the "
                f"slowest live worker (worker {slow} at clock {at})")


class SyncRule(Rule):
    """A key is updated with the mean of the step's pushes once every live worker pushed it;
    the version goes up once every key is."""

    name = "sync"

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self._sum: dict[int, torch.Tensor] = {}  # key -> sum of the step's gradients
        self.summing = self.most_summing = 0  # their bytes now, and at most
        self._rows: dict[int, list] = {}  # pushed by rows: key -> [(ids, rows), ...] of the step
        self._pushed: dict[int, set[int]] = {}  # key -> workers that pushed it this step
        self._updated: set[int] = set()  # keys already updated in this step
        self._step_lr: float | None = None  # the learning rate this step's pushes carry
        self._step_hold: bool | None = None  # whether this step's pushes hold the update for a clip
        self._held: dict[int, torch.Tensor] = {}  # held step: key -> its averaged gradient
        self._sq: dict[int, float] = {}  # held step -> sum of squares of its averaged gradient here
        self._scale: dict[int, float] = {}  # held step -> the clip coefficient it was updated with

    def check_step(self, w: int, step: int) -> None:
        if step < self.host.version and (self.host.config.backup_workers or w in self.host.workers.rejoined):
            return  # late: dropped, and answered with the new values
        if step != self.host.version:
            raise Reject(f"sync push for step {step}, but the shard is at step {self.host.version}; "
                         f"pull with min_version={step} first")

    def check_push(self, w: int, step: int, msg: Message) -> None:
        hold, lr = bool(msg.get("hold")), msg.get("lr")
        if hold and self.host.config.backup_workers:
            raise Reject(f"worker {w} holds step {step} for a clip, but with ps.backup_workers="
                         f"{self.host.config.backup_workers} a step's late pushes are dropped: no clip")
        if hold and (msg.get("pull") or any(i is not None for i in msg.ids)):
            raise Reject(HOLD_ONLY_SYNC)
        if self._step_hold is not None and hold != self._step_hold:
            raise Reject(f"worker {w} pushed step {step} {'with' if hold else 'without'} 'hold', another "
                         f"worker {'without' if hold else 'with'}: every worker must clip, or none")
        if lr is not None and self._step_lr not in (None, lr):
            raise Reject(f"worker {w} pushed step {step} with lr={lr:g}, another worker with "
                         f"lr={self._step_lr:g}: every worker must run the same learning-rate schedule")

    def push(self, w, step, keys, grads, ids, lr, hold) -> None:
        self.readied = set()
        self.host.workers.note_keys(w, step, keys)
        stale = self.over() or step < self.host.version
        late = {j for j, k in enumerate(keys) if stale or k in self._updated}
        if late:
            self.dropped.setdefault(step, set()).add(w)
            self.host.counters["dropped_keys"] += len(late)
            if len(late) == len(keys):
                return
            keys, grads, ids = ([x[j] for j in range(len(keys)) if j not in late] for x in (keys, grads, ids))
        self._step_lr = lr if lr is not None else self._step_lr
        self._step_hold = hold
        for k, g, i in zip(keys, grads, ids):
            if i is not None:
                self._rows.setdefault(k, []).append((i, g))
            elif k in self._sum:
                self._sum[k].add_(g)
            else:
                self._sum[k] = g  # built on the received frame, which is ours to keep and write
                self.summing += g.nbytes
                self.most_summing = max(self.most_summing, self.summing)
            self._pushed.setdefault(k, set()).add(w)
        self._update_ready(keys)  # a push makes only its own keys ready

    def over(self) -> bool:
        """With backups, once a worker has left the run is over: a worker still pushing (its
        loop ran past the shards' last step) must not go on training alone."""
        return bool(self.host.config.backup_workers and self.host.workers.left)

    def needed(self, live: set[int]) -> int:
        """How many live workers' pushes of a key make it ready: all, or all but the backups
        once every live worker has joined (a run starts when all are there)."""
        if live - self.host.workers.joined:
            return len(live)
        return max(1, len(live) - self.host.config.backup_workers)

    def joined(self, w: int) -> None:
        self._update_ready()

    def version_of(self, keys: Sequence[int]) -> int:
        """Keys updated in the current step are one ahead of the shard."""
        if not self._updated:
            return self.host.version
        return self.host.version + int(all(k in self._updated for k in keys))

    def worker_gone(self) -> None:
        self._update_ready()

    def rejoin(self, w: int) -> bool:
        """Counted in from the next step: at once if this one has not started here, else once
        it is done (it may now finish without w), when the join is answered with its values."""
        if not (self._pushed or self._updated or self._held):
            return True
        self.host.workers.joining.add(w)
        self._update_ready()
        return w not in self.host.workers.joining

    def _update_ready(self, keys: Sequence[int] | None = None) -> None:
        """Update each key (of keys; None: of the step) every live worker has pushed; once all
        are, the step is done. A held step (a clip) keeps the averaged gradients until a pull
        brings the scale. A push passes its own keys, the only ones it can make ready: a look
        at every key pushed so far after each message cost a shard of K keys K*K looks a step."""
        host, live = self.host, self.host.workers.live()
        if not live:
            return
        needed, pushed = self.needed(live), self._pushed
        ready = [k for k in (pushed if keys is None else keys) if k in pushed and k not in self._updated
                 and k not in self._held and len(live & pushed[k]) >= needed]
        if ready and self.readied is not None:
            self.readied.update(ready)
        given, divisors = [], []  # the gradients of ready, in its order, and what averages each, for host.apply
        for k in ready:
            count = len(self._pushed[k])
            if k in self._rows:  # every worker's rows, duplicates summed
                parts = self._rows.pop(k)
                grad = grad_of(host.chunks[k].shape, torch.cat([g for _, g in parts]),
                               torch.cat([i for i, _ in parts]), coalesced=len(parts) == 1)
                grad, divisor = grad / count, 1
            else:
                grad, divisor, shape = self._sum.pop(k), count, host.chunks[k].shape
                if grad.shape != shape:  # (a whole key's frame is already its flat chunk's shape)
                    grad = grad.reshape(shape)
                self.summing -= grad.nbytes
            if self._step_hold:
                self._held[k] = grad.div_(divisor) if divisor != 1 else grad
            else:
                given.append(grad)
                divisors.append(divisor)
        if self._step_hold:
            if ready and len(self._held) == len(host.keys):  # the step's gradient is complete here
                self._sq[host.version] = float(sum(self._held[k].double().pow(2).sum() for k in host.keys))
            return
        if ready:
            named = f"key {ready[0]}" if len(ready) == 1 else f"keys {ready[0]}..{ready[-1]} ({len(ready)})"
            host.apply(ready, lambda: f"update {named} (step {host.version}, {len(live)} workers)", count=False,
                       lr=self._step_lr, grads=given, divisors=divisors)
            self._updated.update(ready)
        if len(self._updated) == len(host.keys):
            self._end_step()

    def _end_step(self) -> None:
        self.readied = None  # a new version: any waiting request may go on
        self.host.workers.joining.clear()  # rejoined workers count from the next step
        self.host.counters["updates"] += 1
        self._step_lr = self._step_hold = None
        self._updated.clear()
        self._pushed.clear()
        self._rows.clear()
        self.host.bump()

    # -- held steps ----------------------------------------------------------------------------

    def check_norm(self) -> None:
        pass

    def norm_ready(self, step: int) -> bool:
        return step in self._sq

    def norm_of(self, step: int) -> float:
        return self._sq[step]

    def norm_waits_for(self, step: int) -> str:
        return (f"every key of held step {step} (shard at step {self.host.version}, "
                f"{len(self._held)} of {len(self.host.keys)} keys in)")

    def scale(self, msg: Message) -> None:
        """The first pull with the held step's clip scale makes the update (every key's averaged
        gradient times the scale); later ones must bring the same scale."""
        host = self.host
        step, scale = msg.get("min_version", host.version + 1) - 1, msg.get("scale")
        if step in self._scale:
            if self._scale[step] != scale:
                raise Reject(f"worker {msg.worker} pulled step {step} with scale {scale!r}, the step was "
                             f"updated with {self._scale[step]!r}: every worker must compute the same clip")
            return
        if step != host.version or step not in self._sq:
            raise Reject(f"worker {msg.worker} sent a clip scale for step {step}, but this shard (at step "
                         f"{host.version}) holds {'no' if not self._held else 'an incomplete'} step to scale")
        keys = list(self._held)
        given = [g.mul_(scale) if scale != 1.0 else g for g in self._held.values()]
        host.apply(keys, f"update, clipped by {scale:.6g} (step {step})", count=False, lr=self._step_lr,
                   grads=given)
        self._scale[step] = scale
        for kept in (self._scale, self._sq):
            for old in [s for s in kept if s < step - HELD_STEPS_KEPT]:
                del kept[old]
        self._held.clear()
        self._updated.update(keys)
        self._end_step()


RULES: dict[str, type[Rule]] = {r.name: r for r in (SyncRule, AsyncRule, SSPRule)}
assert tuple(RULES) == MODES, "one rule per mode of ps.protocol.MODES"


def rule_for(mode: str) -> type[Rule]:
    """The rule named mode, one of MODES (else ValueError)."""
    if mode not in RULES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return RULES[mode]


def make_rule(mode: str, host: Host) -> Rule:
    """The rule named mode, working on host."""
    return rule_for(mode)(host)
