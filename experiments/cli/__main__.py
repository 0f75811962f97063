"""`python -m experiments.cli`: psar without its console script."""

from experiments.cli import main

main()
