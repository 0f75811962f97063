"""`psar`: the command line. Thin: the library does the work, errors become one line."""

import os
import sys

from experiments.runtime import zygote

# The commands that start a run's processes: they fork from a zygote, whose torch import runs
# beside this process's own (below) rather than after it.
if os.path.basename(sys.argv[0]) in ("psar", "-m", "__main__.py") and sys.argv[1:2] in (["run"], ["launch"], ["compare"]) \
        and "--help" not in sys.argv:
    zygote.shared()

import importlib  # noqa: E402

import click  # noqa: E402

COMMANDS = {
    "bench": ("running", "bench", "Measure all-reduce, push+pull and the engines' throughput."),
    "compare": ("reporting", "compare", "Run an experiment or comparison with every engine: table, figures."),
    "keys": ("reporting", "keys", "Make CurveZMQ keys for --curve."),
    "launch": ("running", "launch", "Run your own training script on N workers with one engine."),
    "links": ("reporting", "links_cmd", "How busy each emulated link was during the steps of finished runs."),
    "list": ("running", "list_cmd", "List the named experiments, comparisons and engines."),
    "model": ("reporting", "model_cmd", "Alpha-beta cost model of a step: ring against parameter server."),
    "plot": ("reporting", "plot", "Draw the table and figures of finished runs."),
    "predict": ("predicting", "predict_cmd", "Predict each engine's step at other worker counts and links."),
    "run": ("running", "run", "Train an experiment with one engine on this machine."),
    "server": ("running", "server", "Serve one parameter-server shard of a multi-node run."),
    "table": ("reporting", "table_cmd", "Print the comparison table of finished runs."),
    "tensorboard": ("reporting", "tensorboard_cmd", "Write TensorBoard event files for finished runs."),
    "worker": ("running", "worker", "Run one worker of a multi-node job (torchrun, Slurm, by hand)."),
}
"""name -> (module of experiments/cli, attribute, what `psar --help` says of it): a command is
imported (and torch with it) only when it runs or its own help is asked for."""

SUMMARIES = {name: summary for name, (_, _, summary) in COMMANDS.items()}


class Commands(click.Group):
    """psar's commands, each imported when it is used: `psar --help` imports none."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute, _ = COMMANDS[name]
        return getattr(importlib.import_module(f"experiments.cli.{module}"), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUMMARIES[name]) for name in self.list_commands(ctx)])


@click.group(cls=Commands)
def main() -> None:
    """psar: parameter server or ring all-reduce? Train the same model both ways and compare."""
