"""`psar`: the command line. Thin: the library does the work, errors become one line."""

import os
import sys

from experiments.runtime import zygote

# The commands that start a run's processes: they fork from a zygote, whose torch import runs
# beside this process's own (below) rather than after it.
if os.path.basename(sys.argv[0]) in ("psar", "-m", "__main__.py") and sys.argv[1:2] in (["run"], ["launch"], ["compare"]) \
        and "--help" not in sys.argv:
    zygote.shared()

import click  # noqa: E402

from experiments.cli import reporting, running  # noqa: E402


@click.group()
def main() -> None:
    """psar: parameter server or ring all-reduce? Train the same model both ways and compare."""


for _command in (running.list_cmd, running.run, running.launch, running.worker, running.server, running.bench,
                 reporting.compare, reporting.plot, reporting.table_cmd, reporting.tensorboard_cmd,
                 reporting.model_cmd, reporting.keys):
    main.add_command(_command)
