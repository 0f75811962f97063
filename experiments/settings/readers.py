"""Settings given on the command line that the chosen engine never reads.

`--set allreduce.compression=fp16` with ps-ssp, or `--servers 2` with allreduce, is accepted
by the config (every run has every section) but changes nothing; a researcher who set it
expects it to. `unused` names each such setting and why, so that the CLI can say so.
"""

from __future__ import annotations

from experiments.settings.config import RunConfig
from experiments.engines import engines, matches


def setting_key(assignment: str) -> str:
    """The KEY of a `--set KEY=VALUE` assignment."""
    return assignment.split("=", 1)[0].strip()


def readers(key: str) -> tuple[str, ...] | None:
    """The engines that read `key`, or None if every engine does (no engine lists it among
    its engine-specific settings, EngineSpec.reads)."""
    specs = engines().values()
    if not any(matches(key, spec.reads) for spec in specs):
        return None
    return tuple(spec.name for spec in specs if spec.reads_setting(key))


def unused(cfg: RunConfig, overrides=(), servers_given: bool = False) -> list[str]:
    """One line per setting given (a --set KEY=VALUE, or --servers) that cfg's engine ignores."""
    keys = [setting_key(o) for o in overrides] + (["servers"] if servers_given else [])
    out = []
    for key in dict.fromkeys(keys):
        names = readers(key)
        if names is not None and cfg.engine not in names:
            out.append(f"{key} has no effect on --engine {cfg.engine}; only {', '.join(names)} read it")
    for name in ("slow_rank", "kill_rank", "pause_rank"):
        if getattr(cfg.fault, name) >= cfg.workers:
            out.append(f"fault.{name}={getattr(cfg.fault, name)} has no effect: there are {cfg.workers} "
                       f"workers, ranks 0..{cfg.workers - 1}")
    for rank, step in (("kill_rank", "kill_step"), ("pause_rank", "pause_step")):
        if getattr(cfg.fault, rank) >= 0 and getattr(cfg.fault, step) >= cfg.steps:
            out.append(f"fault.{step}={getattr(cfg.fault, step)} has no effect: the run has {cfg.steps} steps")
    if cfg.fault.pause_rank >= 0 and not cfg.fault.pause_s:
        out.append(f"fault.pause_rank={cfg.fault.pause_rank} has no effect with fault.pause_s=0")
    if cfg.fault.slow_rank >= 0 and cfg.fault.slow_factor == 1.0:
        out.append(f"fault.slow_rank={cfg.fault.slow_rank} has no effect with fault.slow_factor=1")
    return out
