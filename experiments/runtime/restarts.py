"""Restarts of a run's workers on this machine (`--max-restarts K`), at most K. Under allreduce
and ddp, torchrun's: when a worker dies, every worker is stopped and started again from the
last checkpoint the ranks share. What each restart cost is written to summary.json:

    restarts      how many times the workers were restarted
    steps_lost    steps done before a failure that the restarted workers did again, summed
    recovery_s    seconds from the failures to the first step after each restart, summed
                  (None without a restart)
    restart_log   per restart: which process failed and how, the ranks started again, the
                  step reached and the one they went on from, and recovery_s split into
                  process_start_s (stopping the others, starting the processes up to their
                  job), checkpoint_s (reading and restoring it), rendezvous_s (meeting the
                  others or the shards again, agreeing on the model) and rest_s (building the
                  model and data, the first step itself)

Under the parameter servers only the worker that died is started again: it rejoins the
running shards and goes on at their step (ps.shard.consistency), so nothing is redone.
Restarted processes are fresh interpreters, as torchrun's are (not forks of the zygote).
"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments.rundir.checkpoint import worker_path
from experiments.rundir.metrics import read_metrics
from experiments.rundir.starts import read_starts


def check_restartable(cfg) -> None:
    """ValueError naming what keeps a run of cfg (a RunConfig) from restarting a worker."""
    from experiments.engines import get_engine

    spec = get_engine(cfg.engine)
    if spec.reads_setting("ps.easgd_tau"):
        raise ValueError(f"--max-restarts with {cfg.engine}: each worker's own model is tied to the centre, "
                         "and a new process would start from the centre without it")
    if cfg.compresses_pulls():
        raise ValueError(f"--max-restarts with compress.method={cfg.compress.method} and compress.pull: each "
                         "worker steps its own optimizer on the pulled gradients, whose state a new process "
                         "cannot get back; set compress.pull=false")


class RestartError(RuntimeError):
    """The workers cannot be restarted (their checkpoints disagree); the message says why."""


def checkpoint_step(run_dir: Path, ranks: int) -> int | None:
    """The step every rank's checkpoint is at, None where no rank has one; RestartError when
    some have one and others not, or theirs are at different steps."""
    steps = {}
    for r in range(ranks):
        path = worker_path(run_dir, r)
        if path.exists():
            steps[r] = int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])
    if not steps:
        return None
    if len(steps) < ranks or len(set(steps.values())) > 1:
        held = ", ".join(f"rank {r}: step {steps[r]}" if r in steps else f"rank {r}: none" for r in range(ranks))
        raise RestartError(f"the ranks' checkpoints are not of one step ({held}): a restart would mix them")
    return steps[0]


def steps_done(run_dir: Path) -> int:
    """How many steps the furthest rank has recorded."""
    return max((recs[-1]["step"] + 1 for recs in read_metrics(run_dir).values() if recs), default=0)


class Restarts:
    """The restarts of one run in run_dir of `ranks` workers, at most max_restarts: of every
    worker together (allreduce, ddp: `failed`), or of one that rejoins running shards (the
    parameter servers: `failed_one`)."""

    def __init__(self, run_dir: Path, ranks: int, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ValueError(f"--max-restarts {max_restarts}: must be >= 0")
        self.run_dir, self.ranks, self.max = Path(run_dir), ranks, max_restarts
        self.log: list[dict] = []

    @property
    def count(self) -> int:
        return len(self.log)

    @property
    def left(self) -> bool:
        return self.count < self.max

    def failed(self, failure: str, failed_at: float) -> int | None:
        """A process failed at wall time failed_at (why: failure) and the others are stopped:
        record it and return the step every worker goes on from (None: from the start, no
        checkpoint)."""
        self._close_last()
        resume = checkpoint_step(self.run_dir, self.ranks)
        self.log.append({"failure": failure, "failed_at": failed_at, "ranks": list(range(self.ranks)),
                         "reached_step": steps_done(self.run_dir)})
        return resume

    def failed_one(self, rank: int, failure: str, failed_at: float) -> None:
        """Worker `rank` failed at wall time failed_at and is started again alone."""
        self._close_last()
        recs = read_metrics(self.run_dir).get(rank, [])
        self.log.append({"failure": failure, "failed_at": failed_at, "ranks": [rank],
                         "reached_step": recs[-1]["step"] + 1 if recs else 0})

    def finished(self) -> dict:
        """The summary's keys, once the run has ended."""
        self._close_last()
        recovered = [r["recovery_s"] for r in self.log if r.get("recovery_s") is not None]
        return {"restarts": self.count, "steps_lost": sum(r.get("steps_lost") or 0 for r in self.log),
                "recovery_s": sum(recovered) if recovered else None, "restart_log": self.log}

    def _close_last(self) -> None:
        """The last restart's cost, from the first step its workers recorded after the failure
        and their starts (before a later restart rewrites the metrics from its checkpoint)."""
        if not self.log or "recovery_s" in self.log[-1]:
            return
        last, attempt = self.log[-1], len(self.log)  # the restarted processes' $PSAR_RESTARTS
        metrics = read_metrics(self.run_dir)
        firsts = [next((r for r in metrics.get(rank, []) if r["wall"] > last["failed_at"]), None)
                  for rank in last["ranks"]]
        starts = read_starts(self.run_dir)
        last.update(resumed_step=None, steps_lost=None, recovery_s=None)
        if None in firsts:
            return  # it failed again before every restarted rank had stepped
        resumed = min(r["step"] for r in firsts)
        # the split is the last rank's to step again: the phases of its start add up
        slowest = max(zip(firsts, last["ranks"]), key=lambda fr: fr[0]["wall"])[1]
        start = next((s for s in starts.get(slowest, []) if s["restarts"] == attempt), None)
        recovery = max(r["wall"] for r in firsts) - last["failed_at"]
        last.update(resumed_step=resumed, steps_lost=max(0, last["reached_step"] - resumed), recovery_s=recovery)
        if start is not None:
            phases = {"process_start_s": start["began"] - last["failed_at"], "checkpoint_s": start["checkpoint_s"],
                      "rendezvous_s": start["rendezvous_s"]}
            last.update(**phases, rest_s=recovery - sum(phases.values()))
