"""One worker's run: the job (the lifecycle a named experiment and a user's script share), the
training loop written on it, the engines' builders (the registry they fill is
experiments/engines.py), the single-process reference engine, and the worker's place in the
run (rank, device, threads)."""
