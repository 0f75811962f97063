"""How many of its host's cores a shard takes: threads for its updates, and ZeroMQ's I/O
threads for its connections.

A shard's work on a key is the update (torch kernels, which release the GIL: with SGD, Adam,
AdamW or Adagrad, a key of 8 MiB or more split over threads of the shard's own, torch on one
thread, ps/shard/slices.py, and with SGD's compiled kernel one of 3 MiB or more, over its own,
ps/shard/_split.h; with other optimizers, over torch's intra-op threads, which split a
key above 32768 elements)
and the bytes' way through the kernel (ZeroMQ's I/O threads; each connection is
served by one of them, so a shard answering many workers can use as many as it has
workers). Neither needs more Python threads: a shard's Python work per message stays on
one core, and more threads under the GIL would only add hand-offs. Several shard processes
on one host (`--servers K` on fewer hosts) share its cores the same way.

Processes that share a host split its cores evenly: a launcher that starts ranks and shards
on one machine says how many it started (LOCAL_PROCESSES); a shard started alone on its
host (`psar server`) takes them all.
"""

from __future__ import annotations

import os

LOCAL_PROCESSES = "PSAR_LOCAL_PROCESSES"
"""Environment: how many psar processes (ranks and shards) a launcher started on this host."""

IO_THREADS_MAX = 4
"""At most this many ZeroMQ I/O threads a shard: ZeroMQ's guide gives one a GB/s in or out,
and a shard's link at 100 Gbit/s moves about 12 GB/s each way through the kernel's copies,
which several threads spread over cores; beyond a few, the update on the same cores loses
what the copies gain."""


def host_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def local_processes(environ=os.environ) -> int:
    """How many psar processes share this host: what the launcher said (LOCAL_PROCESSES), else 1."""
    value = environ.get(LOCAL_PROCESSES, "")
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{LOCAL_PROCESSES}={value!r} must be a whole number of processes, at least 1")
    return int(value)


def core_share(processes: int, asked: int = 0) -> int:
    """asked (> 0), or this host's cores shared evenly among `processes` processes, at least 1."""
    if asked < 0 or processes < 1:
        raise ValueError(f"threads={asked} must be >= 0 and processes={processes} >= 1")
    return asked or max(1, host_cores() // processes)


def io_threads(share: int, connections: int) -> int:
    """A shard's ZeroMQ I/O threads: one a connection (a worker's), at most its share of the
    cores and IO_THREADS_MAX, at least 1."""
    return max(1, min(share, connections, IO_THREADS_MAX))
