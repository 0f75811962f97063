"""Training scripts of one's own, run with `psar launch` (see experiments.api)."""
