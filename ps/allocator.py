"""The malloc settings of a process that moves tensors through ZeroMQ: every buffer from one
heap, and the heap's freed memory kept.

ZeroMQ allocates every message it receives with malloc, and torch allocates CPU tensors the
same way. By default glibc gives an allocation above a threshold (128 KiB at first, raised
to the largest chunk freed, up to 32 MiB) a mapping of its own, unmapped when it is freed,
so the next one of that size faults in fresh zeroed pages; a thread other than the main one
allocates from an arena of its own, which never holds more than 64 MiB in one piece and so
maps anything larger whatever the threshold; and free memory at the top of the heap goes
back to the kernel. keep_freed_pages turns the mappings off (M_MMAP_MAX 0), puts every
thread on the main heap (M_ARENA_MAX 1) and keeps up to 256 MiB free at its top: a gradient,
a message or a reply of a size that came before reuses the pages it left.

Measured on 2 cores (mlp-wide x2, 30 steps, 3 rounds alternated, samples/s): ps-sync 331,
352, 350 with f228513's settings (allocations above 32 MiB mapped) against 392, 399, 372;
the all-reduce 363, 371, 339 against 406, 388, 421. A worker's profile showed 15% of its
samples in page faults from the 67 MB gradient of the 4096x4096 layer, allocated afresh by
every backward. The torch.distributed.rpc baseline, whose workers train in its RPC threads,
took 248, 264, 287 with the mappings off but arenas per thread, and 353, 353, 359 with both
settings. `psar bench`'s 64 MiB push+pull took 75.6 and 76.0 ms against 127.5 and 139.9, the
ZeroMQ round trip 61.2 and 62.0 against 116.9 and 128.4; sizes up to 4 MiB moved within the
noise. f228513's 32 MiB threshold alone had taken the 1 MiB push+pull from 2.4-2.5 ms to
1.1-1.2 ms and 4 MiB from 6.0-6.3 to 3.1-4.2 ms, for reasons not pinned down (the counts of
page faults, mappings and unmappings over a whole bench were the same both ways).

The price is memory: a process keeps what it freed (a mlp-wide worker's peak RSS 615 MB
against 505-516 MB). Every engine's processes take the same settings (experiments.harness.job,
the shards, the benchmarks, the rpc baseline), so a comparison does not hand one of them the
allocator's cost. Call it early: a thread that allocated before keeps the arena it had.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's malloc.h
TRIM_THRESHOLD_BYTES = 256 << 20
"""Free memory at the top of the heap beyond this goes back to the kernel."""

_done: bool | None = None


def keep_freed_pages() -> bool:
    """Set this process's malloc to serve every allocation of every thread from its heap and
    to keep up to TRIM_THRESHOLD_BYTES of freed memory at its top; True where it did
    (glibc), False where this C library has no such settings. Once per process (a
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
    # glibc answers 1 where it took the value (a fixed trim threshold ends its adjustment of
    # the mapping threshold too, which no longer matters with no mappings)
    return all(mallopt(option, value) == 1 for option, value in
               ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)))
