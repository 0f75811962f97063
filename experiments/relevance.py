"""Settings given on the command line that the chosen engine never reads.

`--set allreduce.compression=fp16` with ps-ssp, or `--servers 2` with allreduce, is accepted
by the config (every run has every section) but changes nothing; a researcher who set it
expects it to. `unused` names each such setting and why, so that the CLI can say so.
"""

from __future__ import annotations

from .config import RunConfig

# Settings read only by some engines: (key or prefix ending in ".", engines that read it).
READ_BY: list[tuple[str, tuple[str, ...]]] = [
    ("allreduce.algorithm", ("allreduce",)),
    ("allreduce.first_bucket_mb", ("allreduce",)),
    ("allreduce.unused", ("allreduce",)),
    ("allreduce.sparse", ("allreduce",)),
    ("allreduce.", ("allreduce", "ddp")),
    ("ps.staleness", ("ps-ssp",)),
    ("ps.window_mb", ("ps-sync",)),
    ("ps.exchange", ("ps-sync",)),
    ("ps.async_scale", ("ps-async", "ps-ssp")),
    ("ps.", ("ps-sync", "ps-async", "ps-ssp")),
    ("servers", ("ps-sync", "ps-async", "ps-ssp")),
    ("fault.delay_ms", ("allreduce", "ps-sync", "ps-async", "ps-ssp")),
]


def setting_key(assignment: str) -> str:
    """The KEY of a `--set KEY=VALUE` assignment."""
    return assignment.split("=", 1)[0].strip()


def readers(key: str) -> tuple[str, ...] | None:
    """The engines that read `key`, or None if every engine does."""
    for name, engines in READ_BY:
        if key == name or (name.endswith(".") and key.startswith(name)):
            return engines
    return None


def unused(cfg: RunConfig, overrides=(), servers_given: bool = False) -> list[str]:
    """One line per setting given (a --set KEY=VALUE, or --servers) that cfg's engine ignores."""
    keys = [setting_key(o) for o in overrides] + (["servers"] if servers_given else [])
    out = []
    for key in dict.fromkeys(keys):
        engines = readers(key)
        if engines is not None and cfg.engine not in engines:
            out.append(f"{key} has no effect on --engine {cfg.engine}; only {', '.join(engines)} read it")
    if cfg.fault.slow_rank >= cfg.workers:
        out.append(f"fault.slow_rank={cfg.fault.slow_rank} has no effect: there are {cfg.workers} "
                   f"workers, ranks 0..{cfg.workers - 1}")
    if cfg.fault.slow_rank >= 0 and cfg.fault.slow_factor == 1.0:
        out.append(f"fault.slow_rank={cfg.fault.slow_rank} has no effect with fault.slow_factor=1")
    return out
