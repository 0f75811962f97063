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
    "bench": ("running", "bench"),
    "compare": ("reporting", "compare"),
    "keys": ("reporting", "keys"),
    "launch": ("running", "launch"),
    "list": ("running", "list_cmd"),
    "model": ("reporting", "model_cmd"),
    "plot": ("reporting", "plot"),
    "run": ("running", "run"),
    "server": ("running", "server"),
    "table": ("reporting", "table_cmd"),
    "tensorboard": ("reporting", "tensorboard_cmd"),
    "worker": ("running", "worker"),
}
"""name -> (module of experiments/cli, attribute): a command is imported (and torch with it)
only when it runs or its own help is asked for."""

SUMMARIES = {
    "bench": "Measure all-reduce, push+pull and the engines' throughput.",
    "compare": "Run an experiment or comparison with every engine: table, figures.",
    "keys": "Make CurveZMQ keys for --curve.",
    "launch": "Run your own training script on N workers with one engine.",
    "list": "List the named experiments, comparisons and engines.",
    "model": "Alpha-beta cost model of a step: ring against parameter server.",
    "plot": "Draw the table and figures of finished runs.",
    "run": "Train an experiment with one engine on this machine.",
    "server": "Serve one parameter-server shard of a multi-node run.",
    "table": "Print the comparison table of finished runs.",
    "tensorboard": "Write TensorBoard event files for finished runs.",
    "worker": "Run one worker of a multi-node job (torchrun, Slurm, by hand).",
}
"""What `psar --help` says of each command, whole, without importing it."""


class Commands(click.Group):
    """psar's commands, each imported when it is used: `psar --help` imports none."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name]
        return getattr(importlib.import_module(f"experiments.cli.{module}"), attribute)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUMMARIES[name]) for name in self.list_commands(ctx)])


@click.group(cls=Commands)
def main() -> None:
    """psar: parameter server or ring all-reduce? Train the same model both ways and compare."""
