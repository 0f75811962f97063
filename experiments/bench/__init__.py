"""Micro-benchmarks of the engines' communication (`psar bench`, `make bench`) and the
torch.distributed.rpc baseline the parameter server is measured against."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path


def size_label(nbytes: int) -> str:
    """A message size as the tables print it: 1 KiB, 4 MiB, 512 B."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


@contextmanager
def bench_server(log: Path, *args: str):
    """(echo address, shard address) of `python -m ps.benchmark serve` (ps/benchmark.py) with
    one worker and half the host's cores (it and the worker share it), and `args` after them;
    its output to log. Once the block has told it to stop, it has 30 s to end, else it is killed."""
    from experiments.runtime.launcher import free_port
    from ps.cores import core_share

    echo, shard = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "ps.benchmark", "serve", echo, shard, "1",
                                   str(core_share(2)), *args], stdout=out, stderr=out)
    try:
        yield echo, shard
    finally:
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
