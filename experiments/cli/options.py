"""What the commands share: the engine choice, the option groups, one-line errors, run
directories and the one-line summary of a finished run."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import click

from experiments.settings.config import RunConfig
from experiments.engines import EngineSpec
from experiments.engines import engines as registered
from experiments.settings.overrides import OverrideError

ENGINES = registered()
"""The registry itself (a live view: an engine registered later shows up)."""


class EngineChoice(click.Choice):
    """--engine: the registered engines that `keep` admits, read when the option is parsed,
    so that an engine registered after this module was imported is offered too."""

    def __init__(self, keep=lambda spec: True) -> None:
        self._keep = keep
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(name for name, spec in ENGINES.items() if self._keep(spec))

    @choices.setter
    def choices(self, value) -> None:  # click.Choice sets it once; the registry decides
        pass


def serves(spec: EngineSpec) -> bool:
    return spec.uses_servers


def one_per_worker(spec: EngineSpec) -> bool:
    return spec.processes_per_worker


def friendly(fn):
    """Library errors reach the user as one line naming the problem, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (OverrideError, ValueError, RuntimeError, OSError) as err:
            raise click.ClickException(str(err)) from None

    return wrapper


def run_options_for(engines: EngineChoice | None = EngineChoice(), default_engine=None):
    """Options shared by every command that resolves a run's config; --engine offers
    `engines` (None: the command has no --engine)."""
    engine = [click.option("--engine", type=engines, default=default_engine,
                           help="Gradient synchronisation engine "
                           f"[default: {default_engine or RunConfig.engine}].")] if engines else []
    return functools.partial(_run_options, engine + [
        click.option("--steps", type=int, default=None,
                     help="Optimizer steps [default: the experiment's, see `psar list`]."),
        click.option("--seed", type=int, default=None,
                     help=f"Seed of model, data and shards [default: {RunConfig.seed}]."),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
                     help="Where the workers compute: cpu (Gloo) or cuda (NCCL) [default: cpu]."),
        click.option("--curve", type=click.Path(file_okay=False), default=None,
                     help="Key directory from `psar keys`: CurveZMQ authentication and "
                     "encryption between parameter-server shards and workers."),
        click.option("--trace", is_flag=True, default=None,
                     help="Write a Chrome trace (trace.json): forward, backward, every message."),
        click.option("--tensorboard", is_flag=True, default=None,
                     help="Write TensorBoard event files as the run trains (RUN_DIR/tensorboard/); "
                     "needs the tensorboard extra."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override any config key, e.g. --set allreduce.algorithm=ring."),
    ])


def _run_options(options, fn):
    for option in reversed(options):
        fn = option(fn)
    return fn


run_options = run_options_for()


def process_counts(fn):
    """--workers N and --servers S, for the commands that start a run's processes."""
    fn = click.option("--servers", type=int, default=None,
                      help=f"Parameter-server shards (ps-* engines) [default: {RunConfig.servers}].")(fn)
    return click.option("--workers", type=int, default=None,
                        help=f"Number of workers (data shards) [default: {RunConfig.workers}].")(fn)


def _rate(ctx, param, value):
    """--net's RATE, checked here so that the error names --net."""
    if value is not None:
        from experiments.settings.net import parse_rate

        try:
            parse_rate(value)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None
    return value


def net_option(fn):
    """--net RATE: the run on an emulated cluster, for `psar run` and `psar compare`."""
    return click.option("--net", "net", default=None, metavar="RATE", callback=_rate,
                        help="Emulated cluster: each worker (and, with --set net.placement=separate, "
                        "each server shard) on a host of its own, every link shaped to RATE each way "
                        "(tc units: 200mbit, 1gbit). Needs root. --set net.latency_ms=X adds delay; "
                        "--set net.racks=K --set net.uplink=RATE puts the hosts in K racks behind "
                        "uplinks of RATE.")(fn)


def resume_option(what: str, note: str):
    """--resume RUN_DIR, for `what` ("the run"), with a note on what carries over."""
    return click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
                        default=None, help=f"Continue {what} in this directory from its last checkpoint "
                        f"({note}). A finished run is continued only as a copy in --out.")


def restarts_option(fn):
    """--max-restarts K, for `psar run` and `psar launch`."""
    return click.option("--max-restarts", "max_restarts", type=click.IntRange(min=0), default=None, metavar="K",
                        help="When a worker dies, restart as torchrun does, at most K times: allreduce and ddp "
                        "stop every worker and go on from the last checkpoint (--set checkpoint.every=N; "
                        "from the start without one); the parameter-server engines start the dead worker "
                        "again, which rejoins the running shards. summary.json gains restarts, steps_lost "
                        "and recovery_s.")(fn)


def overwrite_option(fn):
    return click.option("--overwrite", is_flag=True, default=False,
                         help="Replace a finished run already in --out (refused without it).")(fn)


def refuse_finished(run_dir: Path, overwrite: bool) -> None:
    """A finished run's results (its summary.json) are never replaced unasked."""
    if not overwrite and (Path(run_dir) / "summary.json").exists():
        raise click.ClickException(f"{run_dir} holds a finished run (it has a summary.json): give another "
                                   f"--out, or --overwrite to replace it")


def run_fields(cfg: RunConfig) -> dict:
    """Every setting of cfg but the workload (a script's model, data and arguments)."""
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in ("experiment", "model", "data")}


def resumed_dir(cfg, resume_dir: Path, out: Path | None, overwrite: bool) -> Path:
    """Where a resumed run goes on: in place, or as a copy in --out when given (a finished run
    only so: resuming it in place would overwrite its results)."""
    from experiments.runtime.launcher import resumable_copy

    if out is not None:  # results already there stay as they are; a copy goes on
        refuse_finished(out, overwrite)
        return resumable_copy(cfg, resume_dir, out)
    if (resume_dir / "summary.json").exists():
        raise click.ClickException(
            f"{resume_dir} has finished (it has a summary.json), and resuming it in place would "
            f"overwrite its results: add --out NEW_DIR to go on from its last checkpoint there")
    return resume_dir


def with_net(overrides, net) -> tuple[str, ...]:
    """--net RATE is net.rate, set before the --set options (net.latency_ms needs it)."""
    return ((f"net.rate={net}",) if net else ()) + tuple(overrides)


def with_board(overrides, tensorboard) -> tuple[str, ...]:
    """--tensorboard is tensorboard=true, refused at once where the package is missing."""
    if not tensorboard:
        return tuple(overrides)
    from experiments.rundir.tensorboard_log import available

    missing = available()
    if missing:
        raise click.ClickException(missing)
    return tuple(overrides) + ("tensorboard=true",)


def with_curve(overrides, curve) -> tuple[str, ...]:
    """--curve DIR is ps.curve_dir, made absolute so every process finds it."""
    return tuple(overrides) + ((f"ps.curve_dir={Path(curve).resolve()}",) if curve else ())


def warn_unused(cfgs: list[RunConfig], overrides, servers_given: bool) -> None:
    """Say which settings given on the command line no run of cfgs reads."""
    from experiments.settings.readers import unused

    lines = [unused(cfg, overrides, servers_given) for cfg in cfgs]
    for line in lines[0] if lines else []:
        if all(line in other for other in lines[1:]):
            click.echo(f"psar: warning: {line}", err=True)


def describe_summary(summary: dict) -> str:
    """One line on a finished run; a figure the run could not measure reads "-" with why."""
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    ev = ", ".join(f"{k} {num(v, '.4f')}" for k, v in (summary.get("eval") or {}).items())
    rate = summary.get("samples_per_sec")
    rate_text = (f"{rate:.0f} samples/s" if rate is not None else
                 "samples/s not measured (no stretch of time in which every worker trained past "
                 "its first step)")
    return (f"{summary['experiment']}/{summary['engine']} x{summary['workers']}: final loss "
            f"{num(summary.get('final_loss'), '.4f')}, eval {ev or '-'}, {rate_text}")


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.experiment}-{cfg.engine}-w{cfg.workers}-{stamp}"
