"""One worker's run: the engine registry and its builders, the job (the lifecycle a named
experiment and a user's script share), the training loop written on it, and the worker's
place in the run (rank, device, threads, injected faults)."""
