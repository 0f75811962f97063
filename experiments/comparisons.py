"""Named comparisons: an experiment, the engines and worker counts to run it with, and the
settings that make the point. `psar compare NAME` runs one; its flags override the grid."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Comparison:
    name: str
    """What `psar compare` is given."""
    experiment: str
    """The named experiment every run of the grid starts from."""
    engines: tuple[str, ...]
    """Engines compared (only the engine changes between runs)."""
    workers: tuple[int, ...]
    """Worker counts."""
    servers: tuple[int, ...] = (1,)
    """Server shard counts for the ps-* engines."""
    overrides: tuple[str, ...] = ()
    """`--set` overrides applied to every run (`--set` on the command line comes after)."""
    steps: int | None = None
    """Steps of every run (None: the experiment's); `--steps` on the command line wins."""
    claim: str = ""
    """The result the comparison reproduces, in one sentence."""


COMPARISONS: dict[str, Comparison] = {c.name: c for c in [
    Comparison(
        "hogwild", "logreg-sparse", ("ps-async", "ps-sync", "allreduce"), (1, 2),
        claim="Hogwild!: on sparse logistic regression, lock-free asynchronous updates rarely "
              "collide, so async throughput grows with workers while the loss still falls."),
    Comparison(
        "straggler", "cnn", ("ps-async", "ps-ssp", "ps-sync", "allreduce"), (2,),
        overrides=("fault.slow_rank=1", "fault.slow_factor=4"), steps=60,
        claim="One worker 4x slower: sync and all-reduce wait for it every step, async does "
              "not, and ssp waits only when the gap exceeds its staleness bound."),
    Comparison(
        "comm-bound", "mlp-wide", ("ddp", "allreduce", "ps-sync", "ps-async"), (1, 2), (1, 2),
        steps=12,
        claim="80 MB of gradients per step: the ring moves 2(N-1)/N of them per link, a single "
              "server shard moves all of them for every worker, two shards halve that."),
]}


def get_comparison(name: str) -> Comparison | None:
    return COMPARISONS.get(name)
