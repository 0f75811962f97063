"""The commands that start processes: run, launch (a user's script), worker, server, bench; and list."""

from __future__ import annotations

import time
from pathlib import Path

import click

from experiments.settings import presets
from experiments.settings.config import RunConfig
from experiments.comparisons.grids import COMPARISONS
from experiments.settings.presets import build_config

from experiments.cli.options import (
    EngineChoice, serves, one_per_worker, friendly, run_options_for, run_options, process_counts,
    net_option, overwrite_option, restarts_option, resume_option, refuse_finished, run_fields, resumed_dir, with_net,
    with_board, with_curve, warn_unused, describe_summary, default_run_dir, ENGINES,
)


@click.command("list")
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
        carries = (f" [compress.method: {', '.join(m for m in spec.compressions if m != 'none')}]"
                   if spec.reads_setting("compress.method") else "")
        click.echo(f"  {spec.name:15s} {spec.summary}{carries}")


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("script", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@process_counts
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory (default: runs/SCRIPT-ENGINE-wN-TIME).")
@click.option("--engine", type=EngineChoice(one_per_worker),
              default=None, help=f"Gradient synchronisation engine [default: {RunConfig.engine}].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where the workers compute: cpu (Gloo) or cuda (NCCL) [default: cpu].")
@click.option("--trace", is_flag=True, default=None, help="Write a Chrome trace (trace.json).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override an engine setting, e.g. --set allreduce.algorithm=ring.")
@resume_option("the script's run", "--set checkpoint.every=K; the script starts its loop at job.start_step")
@restarts_option
@overwrite_option
@net_option
@friendly
def launch(script, script_args, workers, servers, out, engine, device, trace, overrides, net, overwrite,
           resume_dir, max_restarts) -> None:
    """Run your own training SCRIPT (with ARGS) on N workers with one engine, as torchrun
    would, plus the parameter-server shards; the script uses experiments.api (see
    docs/your-own-script.md). Options come before SCRIPT; what follows it is the script's.

    \b
        psar launch --engine ps-sync --workers 2 --servers 2 --out runs/mine train.py --epochs 1
    """
    from experiments.runtime.launcher import launch_batch
    from experiments.settings.script import script_config

    if not script.exists():
        raise click.UsageError(f"script {script} does not exist")
    overrides = with_net(overrides, net)
    if resume_dir is not None:
        from experiments.settings import config as config_mod
        from experiments.settings.config import resolve

        if workers or servers or engine or device or net:
            raise click.UsageError("--resume continues a run as it was configured: give only "
                                   "--trace, --set or --out with it")
        cfg = resolve(config_mod.load(resume_dir / "config.json"), overrides, trace=trace)
        if cfg.experiment != script_config(str(script)).experiment:
            raise click.UsageError(f"{resume_dir} is a run of {cfg.experiment}, not of script {script}")
        cfg = script_config(str(script), script_args, (), **run_fields(cfg))
        run_dir = resumed_dir(cfg, resume_dir, out, overwrite)
    else:
        cfg = script_config(str(script), script_args, overrides, engine=engine, workers=workers,
                            servers=servers, device=device, trace=trace)
        warn_unused([cfg], overrides, servers is not None)
        run_dir = out or Path("runs") / f"{script.stem}-{cfg.engine}-w{cfg.workers}-{time.strftime('%Y%m%d-%H%M%S')}"
        refuse_finished(run_dir, overwrite)
    summary = launch_batch([(cfg, run_dir)], resume=resume_dir is not None, script=[str(script), *script_args],
                           max_restarts=max_restarts)[0]
    click.echo(describe_summary(summary))
    click.echo(f"run directory: {run_dir}")


@click.command()
@click.argument("experiment", type=click.Choice(list(presets.PRESETS)), required=False, metavar="EXPERIMENT")
@process_counts
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Run directory (default: runs/EXPERIMENT-ENGINE-wN-TIME).")
@resume_option("the run", "its config; --steps and --set may change it")
@restarts_option
@overwrite_option
@net_option
@run_options
@friendly
def run(experiment, workers, servers, out, resume_dir, max_restarts, overwrite, net, engine, steps, seed, device,
        curve, trace, tensorboard, overrides) -> None:
    """Train EXPERIMENT with one engine on this machine and write a run directory.

    EXPERIMENT is one of `psar list`'s. Example:

    \b
        psar run cnn --engine ps-sync --workers 2 --servers 2 --steps 50 --out runs/cnn-ps
        psar run --resume runs/cnn-ps --steps 100 --out runs/cnn-ps-100
    """
    overrides = with_net(with_board(with_curve(overrides, curve), tensorboard), net)
    from experiments.settings import config as config_mod
    from experiments.settings.config import resolve
    from experiments.runtime.launcher import launch

    if resume_dir is not None:
        if experiment or workers or servers or engine or seed is not None:
            raise click.UsageError("--resume continues a run as it was configured: give only "
                                   "--steps, --trace, --set or --out with it")
        cfg = resolve(config_mod.load(resume_dir / "config.json"), overrides, steps=steps, trace=trace)
        run_dir = resumed_dir(cfg, resume_dir, out, overwrite)
    else:
        if experiment is None:
            raise click.UsageError("missing EXPERIMENT (or --resume RUN_DIR)")
        cfg = build_config(experiment, overrides, engine=engine, workers=workers, servers=servers,
                           steps=steps, seed=seed, device=device, trace=trace)
        warn_unused([cfg], overrides, servers is not None)
        run_dir = out or default_run_dir(cfg)
        refuse_finished(run_dir, overwrite)
    summary = launch(cfg, run_dir, resume=resume_dir is not None, max_restarts=max_restarts)
    click.echo(describe_summary(summary))
    click.echo(f"run directory: {run_dir}")


@click.command()
@click.argument("experiment", type=click.Choice(list(presets.PRESETS)), metavar="EXPERIMENT")
@click.option("--rank", type=int, default=None, help="This worker's rank (default: $RANK).")
@click.option("--world", type=int, default=None, help="Number of workers (default: $WORLD_SIZE).")
@click.option("--servers", "addresses", default="", callback=lambda c, p, v: _addresses(v),
              help="Parameter-server shards, comma-separated tcp://HOST:PORT in shard order.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directory (shared, or one per host; rank 0 writes the summary).")
@click.option("--rejoin", is_flag=True, default=False,
              help="Take the place of this rank's worker, which died, in a running parameter-server job: "
                   "join the shards again and go on at their step (ps-sync counts it in from the next).")
@run_options
@friendly
def worker(experiment, rank, world, addresses, out, rejoin, engine, steps, seed, device, curve, trace, tensorboard,
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
    overrides = with_board(with_curve(overrides, curve), tensorboard)
    from experiments.harness.distenv import DistEnv
    from experiments.harness.loop import prepare_run_dir
    from experiments.runtime.worker import run_worker

    env = DistEnv.from_environ(rank, world, addresses)
    if rejoin:
        import dataclasses

        env = dataclasses.replace(env, restarts=max(1, env.restarts))
    cfg = build_config(experiment, overrides, engine=engine, workers=env.world,
                       servers=len(addresses) or None, steps=steps, seed=seed, device=device, trace=trace)
    if ENGINES[cfg.engine].uses_servers and not addresses:
        raise click.UsageError(f"--engine {cfg.engine} needs --servers tcp://HOST:PORT,...")
    if rejoin and not ENGINES[cfg.engine].uses_servers:
        raise click.UsageError(f"--rejoin joins running parameter-server shards; --engine {cfg.engine} has none "
                               "(restart its workers together, as torchrun --max-restarts does)")
    warn_unused([cfg], overrides, bool(addresses))
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


@click.command()
@click.option("--steps", type=int, default=15, show_default=True, help="Steps per throughput run.")
@click.option("--rounds", type=int, default=3, show_default=True, help="Interleaved rounds per engine.")
@click.option("--workers", type=int, default=2, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/bench"),
              show_default=True, help="Where bench.json and the runs go.")
@friendly
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


@click.command()
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
@run_options_for(EngineChoice(serves), "ps-sync")
@friendly
def server(bind, experiment, script, workers, shard, out, resume, engine, steps, seed, device, curve, trace,
           tensorboard, overrides) -> None:
    """Serve one parameter-server shard of a multi-node run until every worker has left.

    Example, shard 0 of 2 for two workers on other hosts:

    \b
        psar server --bind tcp://0.0.0.0:5555 --experiment cnn --workers 2 --shard 0/2 \\
            --engine ps-sync --out runs/cnn-ps
        psar server --bind tcp://0.0.0.0:5555 --script train.py --workers 2 --out runs/mine
    """
    overrides = with_board(with_curve(overrides, curve), tensorboard)
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
    warn_unused([cfg], overrides, False)
    result = serve_shard(cfg, index, count, bind, out, resume)
    click.echo(f"shard {index}/{count}: {result}")
