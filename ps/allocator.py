"""The malloc settings of a process that moves tensors through ZeroMQ: large buffers from
the heap, and the heap's freed memory kept.

ZeroMQ allocates every message it receives with malloc, and torch allocates CPU tensors the
same way. glibc adjusts two thresholds as a process runs: an allocation above the first
(128 KiB at first, raised to the largest chunk freed, up to 32 MiB) gets a mapping of its
own, and free memory at the top of the heap beyond the second (twice the first) goes back to
the kernel. keep_freed_pages fixes the first at its ceiling and the second well above it.

Measured with `psar bench` (one worker, one shard, every size from 1 KiB to 64 MiB in turn;
6 pairs of runs alternated, both processes with and without): a 4 MiB push+pull took 4.0 to
5.8 ms with these settings and 5.0 to 7.4 ms without, the ZeroMQ round trip beside it 3.1 to
7.1 and 2.5 to 4.3 ms; ps/zmq 0.59 to 1.41 against 0.51 to 0.58. Sizes up to 256 KiB moved
within the noise. Not pinned down: the counts of page faults, mappings and unmappings over
a whole bench were the same both ways (perf stat, strace), and a loop of 4 MiB push+pulls
alone, without the sizes before it, took the same time both ways. So the sizes that came
and went before are part of it, as they are in a run whose keys have many sizes; how the
settings act there is not known.

Every engine's processes take the same settings (experiments.harness.job, the shards, the
benchmarks), so a comparison does not hand one of them the allocator's cost.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20
"""Allocations up to this size come from the heap: glibc's largest accepted value on 64-bit
systems, and the ceiling of its own adjustment."""
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory at the top of the heap beyond this goes back to the kernel."""

_done: bool | None = None


def keep_freed_pages() -> bool:
    """Set this process's malloc to serve allocations up to MMAP_THRESHOLD_BYTES from its
    heap and to keep up to TRIM_THRESHOLD_BYTES of freed memory at its top; True where it
    did (glibc), False where this C library has no such settings. Once per process (a
    forked child inherits them); later calls return the first one's answer."""
    global _done
    if _done is None:
        _done = _set()
    return _done


def _set() -> bool:
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: malloc keeps its own thresholds")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # glibc answers 1 where it took the value (setting either ends its adjustment of both)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
