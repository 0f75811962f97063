"""The commands that compare runs and read run directories: compare, plot, table, tensorboard,
model; and keys (CurveZMQ keys for --curve)."""

from __future__ import annotations

import os
import shlex
import shutil
import time
from pathlib import Path

import click

from experiments.settings import presets
from experiments.comparisons.grids import COMPARISONS
from experiments.settings.presets import build_config

from experiments.cli.options import (
    friendly, run_options_for, net_option, with_net, with_board, with_curve, warn_unused, ENGINES,
)


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


@click.command()
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
              help="Output directory (default: runs/compare-NAME-TIME); one holding runs is refused "
              "unless --overwrite.")
@click.option("--overwrite", is_flag=True, default=False,
              help="Replace the runs (and table and figures) of an earlier comparison in --out.")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Draw the figures too.")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Run the grid this many times; the table gives each cell's median samples/s "
              "and range, the throughput figure draws the range.")
@net_option
@run_options_for(engines=None)
@friendly
def compare(name, script_args, engines, worker_counts, server_counts, out, overwrite, plots, repeats, net, steps, seed,
            device, curve, trace, tensorboard, overrides) -> None:
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
    overrides = with_board(with_curve(overrides, curve), tensorboard)
    from analysis.results import load_runs
    from analysis.table import failed_rows, legend, markdown, rows, write

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
        variants = [v for v in grid.variants_at(net) if v.engine in engines
                    and (not server_counts or v.servers == "N" or v.servers in server_counts)]
    else:
        variants = variants_of(engines, server_counts or list(grid.servers if grid else (1,)))
    net = net or (grid.net if grid else None) or None
    overrides = with_net((grid.overrides if grid else ()) + tuple(overrides), net)
    from experiments.settings.readers import setting_key

    if not any(setting_key(o) == "threads" for o in overrides):
        # Every cell's workers get the threads the largest cell's have: a 1-worker run on all
        # the cores collapses when they are busy (a speed-up of 26 on 2 cores was measured)
        overrides = (f"threads={max(1, (os.cpu_count() or 1) // max(worker_counts))}",) + overrides
    steps = steps if steps is not None else (grid.steps if grid else None)
    if grid:
        click.echo(f"{grid.name}: {grid.claim}")
    out = out or Path("runs") / f"compare-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    _replace(out, overwrite)
    if not script:
        warn_unused([build_config(experiment, overrides + v.overrides, engine=v.engine, workers=n,
                                   servers=v.shards(n), steps=steps, seed=seed)
                      for v in variants for n in worker_counts], overrides, bool(server_counts))
    if grid and grid.prelude:
        import importlib

        importlib.import_module(f"experiments.comparisons.{grid.prelude}").measure(out, echo=click.echo)
    run_dirs, failures = run_grid(experiment, variants, worker_counts, out, overrides,
                                  steps, seed, device, trace, echo=click.echo, repeats=repeats, script=script,
                                  max_restarts=grid.max_restarts if grid else None)
    runs = load_runs(run_dirs)
    table = rows(runs) + failed_rows(failures)
    csv_path, md_path = write(table, out)
    click.echo("")
    click.echo(markdown(table))
    click.echo(legend(table))
    click.echo(f"table: {md_path} and {csv_path}")
    from analysis.verdict import verdicts

    said = verdicts(runs)
    for line in said:
        click.echo(line)
    if said and not net and not (grid and grid.rates):
        click.echo("next: on a machine's loopback the cores decide, not the network; as root, "
                   "`psar compare link-scaling` runs allreduce and ps-sync on emulated 200mbit links")
    if grid and grid.report and (runs or grid.prelude):
        import importlib

        text, paths = importlib.import_module(f"analysis.{grid.report}").report(runs, out)
        click.echo("")
        click.echo(text)
        for path in paths:
            click.echo(f"{grid.report}: {path}")
    if plots and runs:
        from analysis.plots import plot_all

        for path in plot_all(runs, out):
            click.echo(f"figure: {path}")
    click.echo(f"runs: {out / 'runs'}")
    if failures:
        cells = ", ".join(f"{f['engine']} x{f['workers']}" for f in failures)
        raise click.ClickException(f"{len(failures)} of {len(failures) + len(runs)} runs failed "
                                   f"({cells}); the table shows why")


def _replace(out: Path, overwrite: bool) -> None:
    """An earlier comparison's runs in out are replaced only when asked (--overwrite), and
    then said; before any run starts."""
    earlier = sorted(p.name for p in (out / "runs").iterdir()) if (out / "runs").is_dir() else []
    if not earlier:
        return
    if not overwrite:
        raise click.ClickException(f"{out} holds the runs of an earlier comparison ({len(earlier)} in "
                                   f"{out / 'runs'}): give another --out, or --overwrite to replace them")
    click.echo(f"replacing the {len(earlier)} runs of an earlier comparison in {out / 'runs'}")
    shutil.rmtree(out / "runs")


@click.command()
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@friendly
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
    _say_skipped(run_dirs)


def _say_skipped(run_dirs) -> None:
    """One line per directory of the folders given that is left out, and why."""
    from analysis.results import skipped

    for path, why in skipped(run_dirs):
        click.echo(f"skipped {path}: {why}", err=True)


@click.command("table")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@friendly
def table_cmd(run_dirs) -> None:
    """Print the comparison table of finished RUN_DIRS (run directories, or folders of them
    such as a `psar compare --out` folder), one per experiment; nothing is rerun or written."""
    from analysis.results import by_experiment, load_runs
    from analysis.table import legend, markdown, rows

    groups = by_experiment(load_runs(run_dirs))
    for experiment, runs in groups.items():
        if len(groups) > 1:
            click.echo(f"{experiment}:")
        table = rows(runs)
        click.echo(markdown(table))
        click.echo(legend(table), nl=False)
    _say_skipped(run_dirs)


@click.command("links")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@friendly
def links_cmd(run_dirs) -> None:
    """Print how busy each emulated link was during the steps of finished RUN_DIRS (runs with
    --net, or folders of them): each link's share of a step at its rate, by workers and
    shards, sent and received, and when in a step (tenths); and how busy the host's cores were
    over those steps (where one machine emulated every host, its cores are shared too)."""
    from analysis.hostcpu import line
    from analysis.links import table
    from analysis.results import load_runs

    for run in load_runs(run_dirs):
        click.echo(table(run, str(run.path)))
        host = line(run)
        if host is not None:
            click.echo(host)
    _say_skipped(run_dirs)


@click.command("tensorboard")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@friendly
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


@click.command("model")
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--bench", "bench_path", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("runs/bench/bench.json"), show_default=True,
              help="bench.json written by `psar bench` (alpha and beta are fitted to it).")
@click.option("--validate", is_flag=True, help="Print predicted against measured step time of RUN_DIRS.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("runs/model"),
              show_default=True, help="Where the scaling figures go.")
@friendly
def model_cmd(run_dirs, bench_path, validate, out) -> None:
    """Alpha-beta cost model of one step, ring all-reduce against a parameter server, fitted to
    `psar bench` and to RUN_DIRS (their gradient bytes and compute time); predicts up to 1024
    workers."""
    from analysis import costmodel, sharded, traffic
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
    click.echo("")
    click.echo(sharded.format_memory(runs))
    for path in costmodel.plot_scaling(rows, out):
        click.echo(f"figure: {path}")


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--workers", "names", default="worker", show_default=True, callback=_csv(str),
              help="Comma-separated client names, one keypair each (all allowed to connect).")
@friendly
def keys(directory, names) -> None:
    """Make CurveZMQ keys for --curve DIRECTORY: a server keypair, a keypair per client name,
    and allowed/ with the public keys the servers accept. Existing keys are kept."""
    from ps.security import make_keys

    for name, path in make_keys(directory, tuple(names)).items():
        click.echo(f"{name:14s} {path}")
    click.echo("servers need server.key_secret and allowed/; each worker server.key and its "
               "own NAME.key_secret (--set ps.curve_name=NAME)")
