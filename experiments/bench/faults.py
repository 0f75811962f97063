"""`psar bench`'s fault goals, on loopback, cnn on 4 workers:

1. One worker of four 3x slower (fault.slow_rank): ps-sync with one backup worker keeps at
   least 0.8x of its steps per second without the fault, while plain ps-sync and the ring
   drop to about a third; the faults report's prediction beside each (analysis/faults.py).
   Each pair measured back to back, ROUNDS times interleaved; the median ratio.
2. A killed all-reduce worker (allreduce and ddp, --max-restarts 1, checkpoint.every=20,
   killed at step 50) costs at most the steps since the last checkpoint (10) plus one
   restart, whose time is split into process start, rendezvous and checkpoint load.
3. No survivor of a kill waits longer than its timeout: with the launcher giving them all the
   time they want, how long after the kill every survivor of the ring and of ps-sync had
   ended (the ring's peers see the dead one's connection close; ps-sync's shard waits for it
   ps.worker_timeout_s, then aborts the step), against that timeout; and under ps-async,
   which drops the dead worker and goes on, the survivors' longest step after the kill.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path
from typing import Callable

from analysis.faults import predicted, steps_per_s
from analysis.results import load_run
from experiments.runtime import launcher
from experiments.settings.presets import build_config

ROUNDS = 3
STEPS = 100
SLOW = ("fault.slow_rank=3", "fault.slow_factor=3")
KILL_STEP, EVERY = 50, 20
WORKER_TIMEOUT_S = 10.0


def _launch(out: Path, name: str, engine: str, overrides=(), steps: int = STEPS, **kw):
    cfg = build_config("cnn", ("threads=1",) + tuple(overrides), engine=engine, workers=4,
                       servers=1 if engine.startswith("ps-") else None, steps=steps)
    run_dir = out / name
    launcher.launch(cfg, run_dir, quiet=True, deadline_s=600, **kw)
    return load_run(run_dir)


def straggler(out: Path, echo: Callable[[str], None]) -> dict:
    variants = {"allreduce": ("allreduce", ()), "ps-sync": ("ps-sync", ()),
                "ps-sync+backup": ("ps-sync", ("ps.backup_workers=1",))}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    guesses: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(ROUNDS):
        for name, (engine, extra) in variants.items():
            none = _launch(out, f"{name}-none-r{r}", engine, extra)
            slow = _launch(out, f"{name}-slow-r{r}", engine, extra + SLOW)
            ratios[name].append(steps_per_s(slow) / steps_per_s(none))
            guesses[name].append(predicted(slow, none))
    report = {}
    for name in variants:
        ratio, guess = statistics.median(ratios[name]), statistics.median(guesses[name])
        goal = ">= 0.8" if "backup" in name else "about 1/3"
        echo(f"  3x straggler of 4, {name}: {ratio:.2f}x its no-fault steps/s (rounds "
             f"{', '.join(f'{x:.2f}' for x in ratios[name])}), predicted {guess:.2f}x (goal {goal})")
        report[name] = {"ratio": ratio, "rounds": ratios[name], "predicted": guess}
    return report


def restart(out: Path, echo: Callable[[str], None]) -> dict:
    report = {}
    for engine in ("allreduce", "ddp"):
        run = _launch(out, f"{engine}-kill", engine, (f"checkpoint.every={EVERY}", "fault.kill_rank=3",
                                                      f"fault.kill_step={KILL_STEP}"), max_restarts=1)
        (log,) = run.summary["restart_log"]
        since = KILL_STEP - KILL_STEP // EVERY * EVERY
        echo(f"  {engine}, rank 3 killed at step {KILL_STEP}, checkpoint every {EVERY}: {log['steps_lost']} steps "
             f"lost (goal <= {since}), recovery {log['recovery_s']:.2f} s = process start "
             f"{log['process_start_s']:.2f} + checkpoint {log['checkpoint_s']:.3f} + rendezvous "
             f"{log['rendezvous_s']:.2f} + first step and the rest {log['rest_s']:.2f}")
        report[engine] = {k: log[k] for k in ("steps_lost", "recovery_s", "process_start_s", "checkpoint_s",
                                              "rendezvous_s", "rest_s")}
    return report


@contextlib.contextmanager
def _patient_launcher(grace_s: float):
    """The launcher waits up to grace_s for the others after a process failed (its own
    FAILURE_GRACE_S stops them after 2 s), so that what they do by themselves shows."""
    kept = launcher.FAILURE_GRACE_S
    launcher.FAILURE_GRACE_S = grace_s
    try:
        yield
    finally:
        launcher.FAILURE_GRACE_S = kept


def survivors(out: Path, echo: Callable[[str], None]) -> dict:
    report = {}
    timeouts = (f"ps.worker_timeout_s={WORKER_TIMEOUT_S:g}", "ps.heartbeat_s=0.5")
    for engine in ("allreduce", "ps-sync", "ps-async"):
        name = f"{engine}-survivors"
        with _patient_launcher(10 * WORKER_TIMEOUT_S):
            start = time.time()
            try:
                _launch(out, name, engine, timeouts + ("fault.kill_rank=3", "fault.kill_step=20"), steps=60)
            except launcher.LaunchError:
                pass
            ended = time.time()
        killed = json.loads((out / name / "logs" / "fault-rank3.json").read_text())["wall"]
        records = [json.loads(line) for r in range(3)
                   for line in (out / name / "metrics" / f"rank{r}.jsonl").read_text().splitlines()]
        after = [r["step_s"] for r in records if r["wall"] > killed]
        longest = max(after, default=0.0)
        echo(f"  {engine}, rank 3 of 4 killed at step 20: every survivor ended {ended - killed:.1f} s after the "
             f"kill ({ended - start:.1f} s after the start); survivors' longest step after it {longest:.2f} s "
             f"(ps.worker_timeout_s {WORKER_TIMEOUT_S:g})")
        report[engine] = {"ended_after_s": ended - killed, "longest_step_after_s": longest,
                          "steps_after": len(after)}
    return report


def faults_goals(out: Path, echo: Callable[[str], None] = print) -> dict:
    out = Path(out) / "faults"
    echo("faults, cnn on 4 workers, loopback:")
    return {"straggler": straggler(out, echo), "restart": restart(out, echo), "survivors": survivors(out, echo)}
