"""`psar predict`: measured runs carried to other worker counts and links (analysis/predict.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from experiments.cli.options import friendly

NET_KEYS = ("net.placement", "net.racks", "net.uplink", "net.latency_ms", "net.fabric")
MODEL_KEYS = ("model.params_mb",)
CALIBRATION_WAIT = 0.5
"""Below this share of its step waited after backward, a calibration run's ratio is noted as
read off little (docs/cost-model.md: two sets of runs moved it from 0.96 to 1.55)."""


def _given(settings: tuple[str, ...]) -> dict[str, str]:
    """--set's KEY=VALUE items, each KEY one of NET_KEYS and MODEL_KEYS (the last wins)."""
    given = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or key not in NET_KEYS + MODEL_KEYS:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(NET_KEYS + MODEL_KEYS)}",
                                     param_hint="--set")
        given[key] = value
    return given


def _params_bytes(given: dict[str, str]) -> float | None:
    """model.params_mb in bytes (None: the runs' model)."""
    if "model.params_mb" not in given:
        return None
    try:
        mb = float(given["model.params_mb"])
    except ValueError:
        mb = -1.0
    if mb <= 0:
        raise click.BadParameter(f"model.params_mb={given['model.params_mb']!r}: expected MB of parameters > 0",
                                 param_hint="--set")
    return mb * 1e6


def _targets(workers: str, net: str, servers: int, given: dict[str, str], message_us: float | None = None,
             own_message_us: float | None = None, shard: tuple = (None, None)):
    from analysis.predict import Target
    from experiments.settings.net import parse_rate

    try:
        counts = [int(w) for w in workers.split(",") if w.strip()]
    except ValueError:
        raise click.BadParameter(f"{workers!r}: expected worker counts such as 4,16,64", param_hint="--workers")
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"{workers!r}: expected worker counts >= 1", param_hint="--workers")
    placement = given.get("net.placement", "colocated")
    if placement not in ("colocated", "separate"):
        raise click.BadParameter(f"net.placement={placement!r}: expected colocated or separate", param_hint="--set")
    uplink = parse_rate(given["net.uplink"]) / 8 if given.get("net.uplink") else None
    return [Target(n, parse_rate(net) / 8, servers, placement, int(given.get("net.racks", 1)), uplink,
                   float(given.get("net.latency_ms", 0)) / 1e3, _seconds(message_us), _fabric(given),
                   _seconds(own_message_us), *shard) for n in counts]


def _seconds(us: float | None) -> float | None:
    return None if us is None else us / 1e6


def _fabric(given: dict[str, str]) -> float | None:
    """net.fabric in bytes/s (None: not given)."""
    from experiments.settings.net import parse_rate

    if not given.get("net.fabric"):
        return None
    try:
        return parse_rate(given["net.fabric"]) / 8
    except ValueError as err:
        raise click.BadParameter(f"net.fabric={given['net.fabric']!r}: {err}", param_hint="--set") from None


@click.command("predict")
@click.argument("run_dirs", nargs=-1, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--workers", default="", help="Comma-separated worker counts to predict, e.g. 4,16,1024.")
@click.option("--net", default="", help="Each host's link rate, tc's syntax (100mbit, 25gbit).")
@click.option("--servers", type=int, default=1, show_default=True, help="Parameter-server shards.")
@click.option("--engines", default="", help="Comma-separated engines or labels (default: the runs').")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="The cluster: net.placement=colocated|separate, net.racks, net.uplink, net.latency_ms, "
                   "net.fabric=RATE (what all its links carry at once; with --validate, the runs' machine's); "
                   "model.params_mb=MB: a model of that many MB of parameters (compute grows in proportion).")
@click.option("--message-us", type=click.FloatRange(min=0), default=None,
              help="A message's fixed cost to a rank that sends or receives it, in us, on the target "
                   "(default: 250, measured on this project's emulated links on 2 cores).")
@click.option("--bench", "bench_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="psar bench's bench.json, run on the target's machines: a message's fixed cost is half "
                   "the per-step latency of its all-reduce fit (in place of --message-us), the library's, and "
                   "its ring's for psar's own collectives; a shard's own time on a message and on a byte, "
                   "fitted to its legs (default: 42.6 us and 118 us a MiB, measured on 2 cores); with "
                   "--validate, the fabric it measured too (psar compare predict's, in place of net.fabric).")
@click.option("--validate", is_flag=True,
              help="Predict each run with more workers than the fewest from those alone, on its own "
                   "cluster, and print the error beside its measured step (with --bench or --message-us: "
                   "the cost of a message on the machines the runs ran on).")
@click.option("--published", is_flag=True,
              help="Print each encoded published scaling result beside psar's prediction of its setting "
                   "(no RUN_DIRS), and those that cannot be encoded, with why.")
@click.option("--map", "map_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a figure (.png): the fastest engine over 2-1024 workers (or --workers) and 100mbit-"
                   "400gbit, the runs given marked, and each engine's scaling at --net (or the runs' rate).")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@friendly
def predict_cmd(run_dirs, workers, net, servers, engines, settings, message_us, bench_path, validate, published,
                map_path, as_json) -> None:
    """Predict each engine's step at other worker counts and links from RUN_DIRS (runs on
    emulated links): its compute and its exchange played over the target's links, scaled by
    the runs' own measured-to-played ratio. Example:

    \b
        psar predict runs/ar-2 runs/ps-2 --workers 4,64 --net 100mbit --servers 4 --set net.placement=separate
        psar predict --validate runs/grid/*
        psar predict --published
    """
    from analysis.predict import Machine, predict
    from analysis.results import load_runs
    from experiments.engines import label_info

    given = _given(settings)
    own_message_us = None  # psar's own collectives': as message_us
    runs_fabric = _fabric(given)  # with --validate, what the runs' machine's links carried at once
    shard = (None, None)  # a shard's own seconds a message and a byte (None: analysis/predict.py's defaults)
    if bench_path is not None:
        if message_us is not None:
            raise click.UsageError("give a message's cost by --message-us or read it from --bench, not both")
        try:
            machine = Machine.from_bench(bench_path)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--bench") from None
        message_us, own_message_us = machine.message * 1e6, machine.own_message * 1e6
        shard = (machine.shard_message, machine.shard_byte)
        if validate and machine.fabric is not None:
            if runs_fabric is not None:
                raise click.UsageError("give the runs' fabric by --set net.fabric or read it from --bench, not both")
            runs_fabric = machine.fabric

    if published:
        _print_published(as_json)
        return
    if not run_dirs:
        raise click.UsageError("give the RUN_DIRS to predict from (or --published)")
    runs = load_runs(run_dirs)
    if validate:
        _print_validation(runs, as_json, message_us, runs_fabric, own_message_us, shard)
        return
    labels = [label_info(e.strip())[1].name for e in engines.split(",") if e.strip()] or \
        list(dict.fromkeys(r.label for r in runs))
    if map_path is not None:
        _draw_map(runs, labels, map_path, workers, net, servers, given, message_us, own_message_us, shard)
        return
    if not workers or not net:
        raise click.UsageError("--workers and --net name the cluster to predict (or give --validate or --map)")
    rows = predict(runs, labels, _targets(workers, net, servers, given, message_us, own_message_us, shard),
                   _params_bytes(given))
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    click.echo(f"{'engine':<28}{'workers':>8}{'servers':>8}{'step ms':>10}{'compute ms':>11}{'comm ms':>10}"
               f"{'samples/s':>11}{'efficiency':>11}{'worker MB':>10}{'shard MB':>9}  calibrated")
    for r in rows:
        shard = f"{r['shard_link_bytes'] / 1e6:.3g}" if r["shard_link_bytes"] is not None else ""
        click.echo(f"{r['engine']:<28}{r['workers']:>8}{r['servers'] or '':>8}{1e3 * r['step_s']:>10.1f}"
                   f"{1e3 * r['compute_s']:>11.1f}{1e3 * r['comm_s']:>10.1f}"
                   f"{r['samples_per_s'] or 0:>11.0f}{100 * r['efficiency']:>10.0f}%"
                   f"{r['worker_link_bytes'] / 1e6:>10.3g}{shard:>9}  {'yes' if r['calibrated'] else 'no: ideal'}"
                   f"{'  fastest' if r['fastest'] else ''}")
    beyond: dict[str, list[int]] = {}  # engine: the fan-ins above its runs', and theirs
    for r in rows:
        if r["calibration_fan_in"] is not None and r["fan_in"] > r["calibration_fan_in"]:
            beyond.setdefault(r["engine"], [r["calibration_fan_in"]]).append(r["fan_in"])
    for engine, (had, *fan_ins) in beyond.items():
        many = f"{min(fan_ins)}" + (f" to {max(fan_ins)}" if max(fan_ins) > min(fan_ins) else "")
        click.echo(f"note: {engine} with {many} hosts sending into each shard's port at once, where its runs had "
                   f"{had}: a port whose queue drops packets at that fan-in makes the step longer than predicted "
                   "(psar predict --validate names the held-out rows where it did)")
    hidden = {r["engine"]: r["calibration_wait_share"] for r in rows  # a ratio read off little
              if r["calibrated"] and r["calibration_wait_share"] is not None
              and r["calibration_wait_share"] < CALIBRATION_WAIT}
    for engine, share in hidden.items():
        click.echo(f"note: {engine}'s runs waited at most {share:.0%} of their step after backward: its ratio is read "
                   f"off that remainder, which the run-to-run spread of its compute moves far (calibrate on a run "
                   f"whose exchange its link bounds: at least {CALIBRATION_WAIT:.0%} of the step)")


def _print_validation(runs, as_json: bool, message_us: float | None = None, fabric: float | None = None,
                      own_message_us: float | None = None, shard: tuple = (None, None)) -> None:
    from analysis.predict import validate
    from analysis.validation import table

    rows = validate(runs, message=_seconds(message_us), fabric=fabric, own_message=_seconds(own_message_us),
                    shard=shard)
    click.echo(json.dumps(rows, indent=1) if as_json else table(rows))


def _print_published(as_json: bool) -> None:
    from analysis.published import NOT_ENCODED, RESULTS, rows as published_rows

    rows = published_rows()
    if as_json:
        click.echo(json.dumps({"encoded": rows, "not_encoded": [n.__dict__ for n in NOT_ENCODED]}, indent=1))
        return
    click.echo("scaling efficiency: published, and psar's with the exchange after backward and overlapping it")
    click.echo(f"{'setting':<66}{'published':>10}{'after':>7}{'error':>8}{'overlapped':>11}{'error':>8}"
               f"{'compute ms':>11}{'exchange ms':>12}")
    for r in rows:
        click.echo(f"{r['name']:<66}{100 * r['published']:>9.0f}%{100 * r['predicted']:>6.0f}%"
                   f"{100 * r['error']:>+6.0f}pt{100 * r['predicted_overlapped']:>10.0f}%"
                   f"{100 * r['error_overlapped']:>+6.0f}pt{1e3 * r['compute_s']:>11.0f}{1e3 * r['comm_s']:>12.0f}")
    click.echo("sources:")
    for source in dict.fromkeys(x for r in RESULTS for x in (r.source, r.inputs)):
        click.echo(f"  {source}")
    click.echo("not encoded:")
    for n in NOT_ENCODED:
        click.echo(f"  {n.name} ({n.source}): {n.why}")


def _draw_map(runs, labels, path: Path, workers: str, net: str, servers: int, given, message_us,
              own_message_us=None, shard=(None, None)) -> None:
    from analysis import predict_map

    rate = net or runs[0].summary.get("network", {}).get("rate") or ""
    if not rate:
        raise click.UsageError("--map needs --net, or runs on an emulated network")
    [like] = _targets("2", rate, servers, given, message_us, own_message_us, shard)
    counts = tuple(t.workers for t in _targets(workers, rate, servers, given)) if workers else predict_map.WORKERS
    written = predict_map.draw(runs, labels, path, like, like.rate * 8, counts, params_bytes=_params_bytes(given))
    click.echo(f"wrote {written}")
