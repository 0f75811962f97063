"""`psar`: the command line. Thin: the library does the work, errors become one line."""

from __future__ import annotations

import functools
import os
import shlex
import time
from pathlib import Path

import click

from experiments.settings import presets
from experiments.settings.config import RunConfig
from experiments.harness.engines import EngineSpec
from experiments.harness.engines import engines as registered

ENGINES = registered()
"""The registry itself (a live view: an engine registered later shows up)."""
from experiments.settings.overrides import OverrideError
from experiments.comparisons.grids import COMPARISONS
from experiments.settings.presets import build_config



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


def _serves(spec: EngineSpec) -> bool:
    return spec.uses_servers


def _one_per_worker(spec: EngineSpec) -> bool:
    return spec.processes_per_worker


def _friendly(fn):
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


def net_option(fn):
    """--net RATE: the run on an emulated cluster, for `psar run` and `psar compare`."""
    return click.option("--net", "net", default=None, metavar="RATE",
                        help="Emulated cluster: each worker (and, with --set net.placement=separate, "
                        "each server shard) on a host of its own, every link shaped to RATE each way "
                        "(tc units: 200mbit, 1gbit). Needs root. --set net.latency_ms=X adds delay.")(fn)


def overwrite_option(fn):
    return click.option("--overwrite", is_flag=True, default=False,
                         help="Replace a finished run already in --out (refused without it).")(fn)


def _refuse_finished(run_dir: Path, overwrite: bool) -> None:
    """A finished run's results (its summary.json) are never replaced unasked."""
    if not overwrite and (Path(run_dir) / "summary.json").exists():
        raise click.ClickException(f"{run_dir} holds a finished run (it has a summary.json): give another "
                                   f"--out, or --overwrite to replace it")


def _run_fields(cfg: RunConfig) -> dict:
    """Every setting of cfg but the workload (a script's model, data and arguments)."""
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in ("experiment", "model", "data")}


def _resumed_dir(cfg, resume_dir: Path, out: Path | None, overwrite: bool) -> Path:
    """Where a resumed run goes on: in place, or as a copy in --out when given (a finished run
    only so: resuming it in place would overwrite its results)."""
    from experiments.runtime.launcher import resumable_copy

    if out is not None:  # results already there stay as they are; a copy goes on
        _refuse_finished(out, overwrite)
        return resumable_copy(cfg, resume_dir, out)
    if (resume_dir / "summary.json").exists():
        raise click.ClickException(
            f"{resume_dir} has finished (it has a summary.json), and resuming it in place would "
            f"overwrite its results: add --out NEW_DIR to go on from its last checkpoint there")
    return resume_dir


def _with_net(overrides, net) -> tuple[str, ...]:
    """--net RATE is net.rate, set before the --set options (net.latency_ms needs it)."""
    return ((f"net.rate={net}",) if net else ()) + tuple(overrides)


def _with_board(overrides, tensorboard) -> tuple[str, ...]:
    """--tensorboard is tensorboard=true, refused at once where the package is missing."""
    if not tensorboard:
        return tuple(overrides)
    from experiments.rundir.tensorboard_log import available

    missing = available()
    if missing:
        raise click.ClickException(missing)
    return tuple(overrides) + ("tensorboard=true",)


def _with_curve(overrides, curve) -> tuple[str, ...]:
    """--curve DIR is ps.curve_dir, made absolute so every process finds it."""
    return tuple(overrides) + ((f"ps.curve_dir={Path(curve).resolve()}",) if curve else ())


def _warn_unused(cfgs: list[RunConfig], overrides, servers_given: bool) -> None:
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


@click.group()
def main() -> None:
    """psar: parameter server or ring all-reduce? Train the same model both ways and compare."""


@main.command("list")
def list_cmd() -> None:
    """List the named experiments and the engines."""
    click.echo("experiments:")
    for name in presets.PRESETS:
        click.echo(f"  {name:15s} {presets.describe(name)}")
    click.echo("comparisons (psar compare NAME):")
    for grid in COMPARISONS.values():
        net = f" --net {grid.net}" if grid.net else ""
        click.echo(f"  {grid.name:15s} {grid.experiment}{net}: {grid.claim}")
    click.echo("engines:")
    for spec in ENGINES.values():
        click.echo(f"  {spec.name:15s} {spec.summary}")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("script", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@process_counts
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory (default: runs/SCRIPT-ENGINE-wN-TIME).")
@click.option("--engine", type=EngineChoice(_one_per_worker),
              default=None, help=f"Gradient synchronisation engine [default: {RunConfig.engine}].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where the workers compute: cpu (Gloo) or cuda (NCCL) [default: cpu].")
@click.option("--trace", is_flag=True, default=None, help="Write a Chrome trace (trace.json).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override an engine setting, e.g. --set allreduce.algorithm=ring.")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Continue the script's run in this directory from its last checkpoint "
              "(--set checkpoint.every=K; the script starts its loop at job.start_step). A finished "
              "run is continued only as a copy in --out.")
@overwrite_option
@net_option
@_friendly
def launch(script, script_args, workers, servers, out, engine, device, trace, overrides, net, overwrite,
           resume_dir) -> None:
    """Run your own training SCRIPT (with ARGS) on N workers with one engine, as torchrun
    would, plus the parameter-server shards; the script uses experiments.api (see the README,
    "Your own model"). Options come before SCRIPT; what follows it is the script's.

    \b
        psar launch --engine ps-sync --workers 2 --servers 2 --out runs/mine train.py --epochs 1
    """
    from experiments.runtime.launcher import launch_batch
    from experiments.settings.script import script_config

    if not script.exists():
        raise click.UsageError(f"script {script} does not exist")
    overrides = _with_net(overrides, net)
    if resume_dir is not None:
        from experiments.settings import config as config_mod
        from experiments.settings.config import resolve

        if workers or servers or engine or device or net:
            raise click.UsageError("--resume continues a run as it was configured: give only "
                                   "--trace, --set or --out with it")
        cfg = resolve(config_mod.load(resume_dir / "config.json"), overrides, trace=trace)
        if cfg.experiment != script_config(str(script)).experiment:
            raise click.UsageError(f"{resume_dir} is a run of {cfg.experiment}, not of script {script}")
        cfg = script_config(str(script), script_args, (), **_run_fields(cfg))
        run_dir = _resumed_dir(cfg, resume_dir, out, overwrite)
    else:
        cfg = script_config(str(script), script_args, overrides, engine=engine, workers=workers,
                            servers=servers, device=device, trace=trace)
        _warn_unused([cfg], overrides, servers is not None)
        run_dir = out or Path("runs") / f"{script.stem}-{cfg.engine}-w{cfg.workers}-{time.strftime('%Y%m%d-%H%M%S')}"
        _refuse_finished(run_dir, overwrite)
    summary = launch_batch([(cfg, run_dir)], resume=resume_dir is not None, script=[str(script), *script_args])[0]
    click.echo(describe_summary(summary))
    click.echo(f"run directory: {run_dir}")


@main.command()
@click.argument("experiment", type=click.Choice(list(presets.PRESETS)), required=False, metavar="EXPERIMENT")
@process_counts
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory (default: runs/EXPERIMENT-ENGINE-wN-TIME).")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="Continue the run in this directory from its last checkpoint "
              "(its config; --steps and --set may change it). A finished run is continued "
              "only as a copy in --out.")
@overwrite_option
@net_option
@run_options
@_friendly
def run(experiment, workers, servers, out, resume_dir, overwrite, net, engine, steps, seed, device, curve, trace,
        tensorboard, overrides) -> None:
    """Train EXPERIMENT with one engine on this machine and write a run directory.

    EXPERIMENT is one of `psar list`'s. Example:

    \b
        psar run cnn --engine ps-sync --workers 2 --servers 2 --steps 50 --out runs/cnn-ps
        psar run --resume runs/cnn-ps --steps 100 --out runs/cnn-ps-100
    """
    overrides = _with_net(_with_board(_with_curve(overrides, curve), tensorboard), net)
    from experiments.settings import config as config_mod
    from experiments.settings.config import resolve
    from experiments.runtime.launcher import launch

    if resume_dir is not None:
        if experiment or workers or servers or engine or seed is not None:
            raise click.UsageError("--resume continues a run as it was configured: give only "
                                   "--steps, --trace, --set or --out with it")
        cfg = resolve(config_mod.load(resume_dir / "config.json"), overrides, steps=steps, trace=trace)
        run_dir = _resumed_dir(cfg, resume_dir, out, overwrite)
    else:
        if experiment is None:
            raise click.UsageError("missing EXPERIMENT (or --resume RUN_DIR)")
        cfg = build_config(experiment, overrides, engine=engine, workers=workers, servers=servers,
                           steps=steps, seed=seed, device=device, trace=trace)
        _warn_unused([cfg], overrides, servers is not None)
        run_dir = out or default_run_dir(cfg)
        _refuse_finished(run_dir, overwrite)
    summary = launch(cfg, run_dir, resume=resume_dir is not None)
    click.echo(describe_summary(summary))
    click.echo(f"run directory: {run_dir}")


@main.command()
@click.argument("experiment", type=click.Choice(list(presets.PRESETS)), metavar="EXPERIMENT")
@click.option("--rank", type=int, default=None, help="This worker's rank (default: $RANK).")
@click.option("--world", type=int, default=None, help="Number of workers (default: $WORLD_SIZE).")
@click.option("--servers", "addresses", default="", callback=lambda c, p, v: _addresses(v),
              help="Parameter-server shards, comma-separated tcp://HOST:PORT in shard order.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directory (shared, or one per host; rank 0 writes the summary).")
@run_options
@_friendly
def worker(experiment, rank, world, addresses, out, engine, steps, seed, device, curve, trace, tensorboard,
           overrides) -> None:
    """Run one worker of a multi-node job (torchrun, Slurm or by hand).

    All-reduce and ddp meet through torch.distributed's env:// rendezvous (MASTER_ADDR,
    MASTER_PORT); the parameter-server engines need --servers. Examples:

    \b
        torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29500 \\
            $(which psar) worker quickstart --engine allreduce --out runs/x
        MASTER_ADDR=HOST MASTER_PORT=29500 psar worker quickstart --engine allreduce \\
            --rank 0 --world 2 --out runs/x
        psar worker cnn --engine ps-sync --servers tcp://srv0:5555 --rank 0 --world 2 --out runs/y
    """
    overrides = _with_board(_with_curve(overrides, curve), tensorboard)
    from experiments.harness.distenv import DistEnv
    from experiments.harness.loop import prepare_run_dir
    from experiments.runtime.worker import run_worker

    env = DistEnv.from_environ(rank, world, addresses)
    cfg = build_config(experiment, overrides, engine=engine, workers=env.world,
                       servers=len(addresses) or None, steps=steps, seed=seed, device=device, trace=trace)
    if ENGINES[cfg.engine].uses_servers and not addresses:
        raise click.UsageError(f"--engine {cfg.engine} needs --servers tcp://HOST:PORT,...")
    _warn_unused([cfg], overrides, bool(addresses))
    if ENGINES[cfg.engine].rendezvous and not env.master:
        raise click.UsageError(
            f"--engine {cfg.engine} meets its peers through torch.distributed's rendezvous: set "
            "MASTER_ADDR and MASTER_PORT (rank 0's host and a free port there) for every worker, "
            "or start the workers with torchrun, which sets them")
    prepare_run_dir(cfg, out)
    code = run_worker(out, env, cfg=cfg)
    if code:
        raise SystemExit(code)
    if env.rank == 0:  # rank 0 wrote the summary
        from experiments.rundir import files

        click.echo(describe_summary(files.read_json(out / "summary.json", timeout_s=0)))
    else:
        click.echo(f"rank {env.rank}: {cfg.steps} steps done; its records: {out / 'metrics'}/rank{env.rank}.jsonl")
    click.echo(f"run directory: {out}")


@main.command()
@click.option("--steps", type=int, default=15, show_default=True, help="Steps per throughput run.")
@click.option("--rounds", type=int, default=3, show_default=True, help="Interleaved rounds per engine.")
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench"),
              show_default=True, help="Where bench.json and the runs go.")
@_friendly
def bench(steps, rounds, workers, out) -> None:
    """Measure all-reduce busbw (ring vs library), parameter-server push+pull bandwidth against
    a plain ZeroMQ round trip, and mlp-wide samples/s of every engine against ddp."""
    from experiments.bench import suite as bench_mod

    bench_mod.run(click.echo, steps=steps, rounds=rounds, workers=workers, out=out)


def _addresses(value: str, bind: bool = False) -> tuple[str, ...]:
    """tcp://HOST:PORT addresses, checked now rather than found wrong after a timeout."""
    import socket

    addresses = tuple(a.strip() for a in value.split(",") if a.strip())
    for a in addresses:
        host, _, port = a[6:].rpartition(":") if a.startswith("tcp://") else ("", "", "")
        if not host or not port:
            raise click.BadParameter(f"{a!r} is not an address of the form tcp://HOST:PORT")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise click.BadParameter(f"{a!r}: port {port!r} is not a number from 1 to 65535")
        if bind and host in ("*", "0.0.0.0"):
            continue
        try:
            socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except OSError as err:
            raise click.BadParameter(f"{a!r}: host {host!r} does not resolve ({err})") from None
    return addresses


@main.command()
@click.option("--bind", default="tcp://127.0.0.1:5555", show_default=True,
              help="Address to serve at, tcp://HOST:PORT (127.0.0.1 keeps it on this host; "
              "tcp://0.0.0.0:PORT accepts other hosts).")
@click.option("--experiment", type=click.Choice(list(presets.PRESETS)), default=None,
              help="The experiment the workers run (the shard builds the same initial model).")
@click.option("--script", default=None, metavar="SCRIPT",
              help="In place of --experiment: the workers run this script (experiments.api); "
              "the shard takes the model and optimizer from worker 0.")
@click.option("--workers", type=int, required=True,
              help="Number of workers that will join, each within ps.timeout_s (60 s unless "
              "--set) of the shard's start, or it counts as lost.")
@click.option("--shard", default="0/1", show_default=True, metavar="i/S",
              help="This server's shard i of S shards.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory: this shard's counters (metrics/server<i>.json), trace and "
              "checkpoints (checkpoint/server<i>.pt).")
@click.option("--resume", is_flag=True, help="Start from this shard's checkpoint in --out.")
@run_options_for(EngineChoice(_serves), "ps-sync")
@_friendly
def server(bind, experiment, script, workers, shard, out, resume, engine, steps, seed, device, curve, trace,
           tensorboard, overrides) -> None:
    """Serve one parameter-server shard of a multi-node run until every worker has left.

    Example, shard 0 of 2 for two workers on other hosts:

    \b
        psar server --bind tcp://0.0.0.0:5555 --experiment cnn --workers 2 --shard 0/2 \\
            --engine ps-sync --out runs/cnn-ps
        psar server --bind tcp://0.0.0.0:5555 --script train.py --workers 2 --out runs/mine
    """
    overrides = _with_board(_with_curve(overrides, curve), tensorboard)
    from experiments.runtime.shard import serve_shard

    try:
        index, count = (int(x) for x in shard.split("/"))
    except ValueError:
        raise click.BadParameter(f"{shard!r} is not of the form i/S", param_hint="--shard") from None
    _addresses(bind, bind=True)
    if (experiment is None) == (script is None):
        raise click.UsageError("give --experiment (a named experiment) or --script (your own), one of them")
    if script:
        from experiments.settings.script import script_config

        cfg = script_config(script, (), overrides, engine=engine, workers=workers, servers=count, seed=seed,
                            device=device, trace=trace)
    else:
        cfg = build_config(experiment, overrides, engine=engine, workers=workers, servers=count,
                           steps=steps, seed=seed, device=device, trace=trace)
    _warn_unused([cfg], overrides, False)
    result = serve_shard(cfg, index, count, bind, out, resume)
    click.echo(f"shard {index}/{count}: {result}")


def _csv(kind):
    def parse(ctx, param, value):
        if value is None:
            return None
        try:
            return [kind(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list, got {value!r}") from None
    return parse


def _experiment_or_script(ctx, param, value: str) -> str:
    if value in presets.PRESETS or value in COMPARISONS or value.endswith(".py"):
        return value
    raise click.BadParameter(f"{value!r} is neither an experiment ({', '.join(presets.PRESETS)}), a "
                             f"comparison ({', '.join(COMPARISONS)}) nor a script (SCRIPT.py)")


@main.command()
@click.argument("name", callback=_experiment_or_script, metavar="NAME")
@click.option("--args", "script_args", default="", metavar="'ARGS'",
              help="A script's own arguments, quoted as one string (NAME a SCRIPT.py).")
@click.option("--engines", default=None, callback=_csv(str),
              help="Comma-separated engines to compare [default: the comparison's, or "
              "local,ddp,allreduce,ps-sync,ps-async,ps-ssp].")
@click.option("--workers", "worker_counts", default=None, callback=_csv(int),
              help="Comma-separated worker counts [default: the comparison's, or 1,2].")
@click.option("--servers", "server_counts", default=None, callback=_csv(int),
              help="Comma-separated server shard counts for the ps-* engines [default: 1].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default: runs/compare-NAME-TIME).")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Draw the figures too.")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Run the grid this many times; the table gives each cell's median samples/s "
              "and range, the throughput figure draws the range.")
@net_option
@run_options_for(engines=None)
@_friendly
def compare(name, script_args, engines, worker_counts, server_counts, out, plots, repeats, net, steps, seed, device,
            curve, trace, tensorboard, overrides) -> None:
    """Run an experiment (or a named comparison) with every engine and worker count, only the
    engine changing; write summary.csv, summary.md and the figures.

    NAME is an experiment or a named comparison of `psar list`, or your own training script
    (SCRIPT.py, using experiments.api: see `psar launch`); the options given here win over the
    comparison's own settings. Example:

    \b
        psar compare quickstart --engines allreduce,ps-sync --workers 1,2 --out runs/cmp
        psar compare straggler --steps 30
        psar compare train.py --engines ddp,allreduce,ps-sync --args '--epochs 1'
    """
    overrides = _with_board(_with_curve(overrides, curve), tensorboard)
    from analysis.results import load_runs
    from analysis.table import failed_rows, markdown, rows, write

    from experiments.comparisons.runner import run_grid, variants_of

    grid = COMPARISONS.get(name)
    experiment = grid.experiment if grid else name
    script = [name, *shlex.split(script_args)] if name.endswith(".py") else None
    if script and not Path(name).exists():
        raise click.UsageError(f"script {name} does not exist")
    if script_args and not script:
        raise click.UsageError("--args is for a script (NAME a SCRIPT.py), not for an experiment")
    if script and steps is not None:
        raise click.UsageError("a script decides its own steps: give them in --args")
    unknown = [e for e in engines or () if e not in ENGINES]
    if unknown:
        raise click.BadParameter(f"unknown engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}",
                                 param_hint="--engines")
    single = [e for e in engines or () if script and not ENGINES[e].processes_per_worker]
    if single:
        raise click.BadParameter(f"{', '.join(single)} runs every worker in one process; a script runs one "
                                 "worker per process", param_hint="--engines")
    engines = engines or [e for e in (grid.engines if grid else ENGINES)
                          if not (script and not ENGINES[e].processes_per_worker)]
    worker_counts = worker_counts or list(grid.workers if grid else (1, 2))
    if grid and grid.variants:  # --engines and --servers choose among the comparison's lines
        variants = [v for v in grid.variants if v.engine in engines
                    and (not server_counts or v.servers == "N" or v.servers in server_counts)]
    else:
        variants = variants_of(engines, server_counts or list(grid.servers if grid else (1,)))
    net = net or (grid.net if grid else None)
    overrides = _with_net((grid.overrides if grid else ()) + tuple(overrides), net)
    from experiments.settings.readers import setting_key

    if not any(setting_key(o) == "threads" for o in overrides):
        # Every cell's workers get the threads the largest cell's have: a 1-worker run on all
        # the cores collapses when they are busy (a speed-up of 26 on 2 cores was measured)
        overrides = (f"threads={max(1, (os.cpu_count() or 1) // max(worker_counts))}",) + overrides
    steps = steps if steps is not None else (grid.steps if grid else None)
    if grid:
        click.echo(f"{grid.name}: {grid.claim}")
    out = out or Path("runs") / f"compare-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not script:
        _warn_unused([build_config(experiment, overrides + v.overrides, engine=v.engine, workers=n,
                                   servers=v.shards(n), steps=steps, seed=seed)
                      for v in variants for n in worker_counts], overrides, bool(server_counts))
    run_dirs, failures = run_grid(experiment, variants, worker_counts, out, overrides,
                                  steps, seed, device, trace, echo=click.echo, repeats=repeats, script=script)
    runs = load_runs(run_dirs)
    table = rows(runs) + failed_rows(failures)
    csv_path, md_path = write(table, out)
    click.echo("")
    click.echo(markdown(table))
    click.echo(f"table: {md_path} and {csv_path}")
    from analysis.verdict import verdicts

    said = verdicts(runs)
    for line in said:
        click.echo(line)
    if said and not net:
        click.echo("next: on a machine's loopback the cores decide, not the network; as root, "
                   "`psar compare link-scaling` runs allreduce and ps-sync on emulated 200mbit links")
    if plots and runs:
        from analysis.plots import plot_all

        for path in plot_all(runs, out):
            click.echo(f"figure: {path}")
    click.echo(f"runs: {out / 'runs'}")
    if failures:
        cells = ", ".join(f"{f['engine']} x{f['workers']}" for f in failures)
        raise click.ClickException(f"{len(failures)} of {len(failures) + len(runs)} runs failed "
                                   f"({cells}); the table shows why")


@main.command()
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@_friendly
def plot(run_dirs, out) -> None:
    """Draw the comparison figures and table of finished RUN_DIRS (nothing is rerun).

    A RUN_DIR may also be a folder of runs, such as a `psar compare --out` folder. Runs of
    several experiments get a table and figures each, in OUT/EXPERIMENT/.
    """
    from analysis.plots import plot_all
    from analysis.results import by_experiment, load_runs
    from analysis.table import rows, write

    groups = by_experiment(load_runs(run_dirs))
    for experiment, runs in groups.items():
        where = out / experiment if len(groups) > 1 else out
        for path in (*write(rows(runs), where), *plot_all(runs, where)):
            click.echo(str(path))


@main.command("table")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@_friendly
def table_cmd(run_dirs) -> None:
    """Print the comparison table of finished RUN_DIRS (run directories, or folders of them
    such as a `psar compare --out` folder), one per experiment; nothing is rerun or written."""
    from analysis.results import by_experiment, load_runs
    from analysis.table import markdown, rows

    groups = by_experiment(load_runs(run_dirs))
    for experiment, runs in groups.items():
        if len(groups) > 1:
            click.echo(f"{experiment}:")
        click.echo(markdown(rows(runs)))


@main.command("tensorboard")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@_friendly
def tensorboard_cmd(run_dirs) -> None:
    """Write TensorBoard event files for finished RUN_DIRS (or folders of them, such as a
    `psar compare --out` folder), into each RUN_DIR/tensorboard/; then `tensorboard --logdir`
    on their parent shows them side by side."""
    from analysis.results import expand

    from experiments.rundir.tensorboard_log import available, convert

    missing = available()
    if missing:
        raise click.ClickException(missing.replace("--tensorboard", "psar tensorboard"))
    for run_dir in expand(run_dirs):
        click.echo(str(convert(run_dir)))


@main.command("model")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--bench", "bench_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("runs/bench/bench.json"), show_default=True,
              help="bench.json written by `psar bench` (alpha and beta are fitted to it).")
@click.option("--validate", is_flag=True, help="Print predicted against measured step time of RUN_DIRS.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/model"),
              show_default=True, help="Where the scaling figures go.")
@_friendly
def model_cmd(run_dirs, bench_path, validate, out) -> None:
    """Alpha-beta cost model of one step, ring all-reduce against a parameter server, fitted to
    `psar bench` and to RUN_DIRS (their gradient bytes and compute time); predicts up to 1024
    workers."""
    from analysis import costmodel, traffic
    from analysis.results import load_runs

    runs = load_runs(run_dirs)
    networked = all(r.summary.get("network") for r in runs)
    if validate and networked and not bench_path.exists():  # the links' rate is the model
        click.echo(costmodel.format_validation(costmodel.validate(None, runs), tolerance=0.10))
        return
    if not bench_path.exists():
        raise click.ClickException(f"{bench_path} does not exist: run `psar bench --out "
                                   f"{bench_path.parent}` first, or pass --bench")
    model = costmodel.CostModel.from_bench(bench_path)
    click.echo(costmodel.fit_summary(model))
    if validate:
        click.echo("")
        click.echo(costmodel.format_validation(costmodel.validate(model, runs),
                                               tolerance=0.10 if networked else 0.25))
        return
    # The least contended run gives the compute time of one worker.
    base = min(runs, key=lambda r: (r.summary["workers"], costmodel.compute_time(r)))
    nbytes, compute_s = traffic.gradient_bytes(base), costmodel.compute_time(base)
    rows = costmodel.scaling(model, nbytes, compute_s, base.config["batch_size"])
    click.echo(f"\n{base.summary['experiment']}: M = {nbytes / 1e6:.2f} MB, T_c = {compute_s * 1e3:.2f} ms "
               f"(from {base.path}), batch {base.config['batch_size']}/worker")
    click.echo(f"{'setting':<16} {'N':>5} {'S':>5} {'step(ms)':>10} {'samples/s':>12}")
    for r in rows:
        if r["workers"] in (1, 2, 8, 64, 256, 1024):
            click.echo(f"{r['setting']:<16} {r['workers']:>5} {r['servers'] or '-':>5} "
                       f"{r['step_s'] * 1e3:>10.2f} {r['samples_per_sec']:>12.0f}")
    for path in costmodel.plot_scaling(rows, out):
        click.echo(f"figure: {path}")


@main.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--workers", "names", default="worker", show_default=True, callback=_csv(str),
              help="Comma-separated client names, one keypair each (all allowed to connect).")
@_friendly
def keys(directory, names) -> None:
    """Make CurveZMQ keys for --curve DIRECTORY: a server keypair, a keypair per client name,
    and allowed/ with the public keys the servers accept. Existing keys are kept."""
    from ps.security import make_keys

    for name, path in make_keys(directory, tuple(names)).items():
        click.echo(f"{name:14s} {path}")
    click.echo("servers need server.key_secret and allowed/; each worker server.key and its "
               "own NAME.key_secret (--set ps.curve_name=NAME)")


if __name__ == "__main__":
    main()
