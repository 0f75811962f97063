"""What every process of one run must agree on, and the check that they do.

Each process resolves its own config from its own command line, so a worker started with
another --seed or --steps would otherwise train quietly on something else. The settings that
must agree (experiment, model, data, seed, steps, batch size, dtype, optimizer, engine and
its settings, faults) are flattened to {"dotted.key": scalar}; a process compares its own
with its peers' at rendezvous (all-reduce, ddp) or at join (the parameter-server shards),
and a mismatch is refused naming each setting and both values.
"""

from __future__ import annotations

import json
from typing import Any

from experiments.settings.config import RunConfig
from experiments.engines import engines, get_engine, matches
from experiments.settings.overrides import to_dict

LOCAL = ("threads", "trace", "tensorboard", "timeout_s", "eval_batch_size", "device", "checkpoint.", "net.")
"""Settings of every engine that each process may choose for itself (keys, or prefixes ending
in a dot); an engine's own are its EngineSpec.own."""

WORKERS_ONLY = ("steps", "batch_size", "data.")
"""Settings only the workers use: a shard compares them between workers, not with its own."""

STORE_KEY = "psar/settings"


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if k == "_type":
            out[f"{prefix}type" if prefix else "type"] = v
        elif isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (list, tuple)):
            out[prefix + k] = json.dumps(v)
        else:
            out[prefix + k] = v
    return out


def settings(cfg: RunConfig, for_server: bool = False) -> dict[str, Any]:
    """{dotted key: scalar} of what must agree across the run (a shard's: what it uses): every
    setting but the local ones and those of other engines that cfg's engine does not read."""
    from experiments.settings.script import ScriptConfig

    flat = _flatten(to_dict(cfg))
    spec = get_engine(cfg.engine)
    others = [name for other in engines().values() for name in other.reads]
    # A script's shard knows neither the script's path nor its arguments: the workers compare those.
    workers_only = WORKERS_ONLY + (("experiment", "model.") if isinstance(cfg.model, ScriptConfig) else ())
    return {k: v for k, v in flat.items()
            if not matches(k, LOCAL + spec.own) and (spec.reads_setting(k) or not matches(k, others))
            and not (for_server and matches(k, workers_only))}


def differences(mine: dict[str, Any], theirs: dict[str, Any], me: str, them: str) -> list[str]:
    """One line per setting that differs: "seed: worker 1 has 3, shard 0 has 0"."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key, "(unset)"), theirs.get(key, "(unset)")
        if a != b:
            out.append(f"{key}: {me} has {a!r}, {them} has {b!r}")
    return out


ADVICE = "start every process of a run with the same experiment, --steps, --seed and --set"


def check_rendezvous_peers(cfg: RunConfig, rank: int) -> None:
    """All-reduce and ddp, right after the rendezvous: rank 0 puts its settings in the store;
    every other rank compares its own with them and leaves its verdict there, which rank 0
    reads, so that both sides of a mismatch stop with the same account of it. A no-op
    without a torch.distributed job. Raises ValueError naming each difference."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()  # waits are bounded by the job's timeout
    if rank == 0:
        store.set(STORE_KEY, json.dumps(settings(cfg), sort_keys=True))
        verdicts = [f"{STORE_KEY}/{r}" for r in range(1, world)]
        store.wait(verdicts)
        bad = [text for text in (store.get(key).decode() for key in verdicts) if text]
        if bad:
            raise ValueError(f"{'; '.join(bad)}: {ADVICE}")
        return
    diff = differences(settings(cfg), json.loads(store.get(STORE_KEY).decode()), f"rank {rank}", "rank 0")
    verdict = f"rank {rank} has other settings than rank 0: {', '.join(diff)}" if diff else ""
    store.set(f"{STORE_KEY}/{rank}", verdict)
    if diff:
        raise ValueError(f"{verdict}: {ADVICE}")
