"""`psar`: the command line. Thin: the library does the work, errors become one line."""

import click

from experiments.cli import reporting, running


@click.group()
def main() -> None:
    """psar: parameter server or ring all-reduce? Train the same model both ways and compare."""


for _command in (running.list_cmd, running.run, running.launch, running.worker, running.server, running.bench,
                 reporting.compare, reporting.plot, reporting.table_cmd, reporting.tensorboard_cmd,
                 reporting.model_cmd, reporting.keys):
    main.add_command(_command)
