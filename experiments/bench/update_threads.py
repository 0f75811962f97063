"""What a shard's update costs its host's cores, on torch's intra-op threads against the
shard's own slice threads (ps/shard/slices.py) and its compiled kernel's (ps/shard/_split.h):
`psar bench`'s table of it.

torch's intra-op threads (OpenMP) spin after every kernel, waiting for the next one, and a
shard updates a key per message with its sockets' waits between: each of those threads
then holds a core it does not use, one its host's ZeroMQ I/O threads and other processes
need. Each row runs in a process of its own (torch's threads are a process's): an SGD update
of a key of N bytes (p -= lr * g, float32) every UPDATE_GAP_S, UPDATE_COUNT times; the
median update and the cores the process held over the run, gaps included (its CPU time over
the wall time). `python -m experiments.bench.update_threads MODE THREADS` runs the rows of
every size, one after the other, and prints them as JSON lines: MODE torch (intra-op threads),
slices (torch on one thread, a key of at least 2 * MIN_SLICE_BYTES split over the shard's
own Python threads, torch's ops on each: a shard's SGD without its compiled kernel, and
Adam's) or kernel (torch on one thread, the compiled kernel, which splits a key of at least
ps.shard.compiled.SPLIT_MIN_BYTES over threads of its own: a shard's SGD where it is built;
absent where it is not).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from experiments.bench import size_label
from ps.cores import host_cores

UPDATE_SIZES = (1 << 20, 4 << 20, 16 << 20)
"""A key below either least split, one above the kernel's (3 MiB) and below the slice
threads' (ps.shard.slices.MIN_SLICE_BYTES: 2 x 4 MiB), and one above both."""
UPDATE_GAP_S = 0.002
"""Between two updates: a shard waiting for the next message."""
UPDATE_COUNT = 200
MODES = ("torch", "slices", "kernel")


def one_row(mode: str, threads: int, nbytes: int, gap_s: float = UPDATE_GAP_S, count: int = UPDATE_COUNT) -> dict:
    """The row of this process (it sets torch's threads): see the module's docstring."""
    import statistics

    import torch

    from ps.shard import compiled
    from ps.shard.optim import compiled_sgd, sgd_step
    from ps.shard.slices import SlicePool

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    fused = compiled_sgd() if mode == "kernel" else None
    if mode == "kernel" and fused is None:
        raise ValueError("mode kernel: the compiled kernel is not built here, or rounds otherwise than torch")
    torch.set_num_threads(threads if mode == "torch" else 1)
    slices = SlicePool(threads) if mode == "slices" and threads > 1 else None
    if mode == "kernel":
        compiled.set_threads(threads)
    p = torch.zeros(nbytes // 4)
    p.grad = torch.ones_like(p)
    group = torch.optim.SGD([p], lr=1e-6).param_groups[0]  # a shard's SGD, as ps.shard.optim replays it
    for _ in range(5):  # the threads started, the pages touched
        sgd_step({}, group, [p], slices, fused=fused)
    took = []
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(count):
        time.sleep(gap_s)
        start = time.perf_counter()
        sgd_step({}, group, [p], slices, fused=fused)
        took.append(time.perf_counter() - start)
    cores = (time.process_time() - cpu) / (time.perf_counter() - wall)
    if slices is not None:
        slices.close()
    pieces = len(slices.cuts(p.numel(), 4)) - 1 if slices is not None else None
    if mode == "kernel":
        pieces = threads if nbytes >= compiled.SPLIT_MIN_BYTES else 1
    return {"mode": mode, "threads": threads, "bytes": nbytes, "gap_s": gap_s, "slices": pieces,
            "update_us": statistics.median(took) * 1e6, "cores": cores}


def thread_counts(cores: int | None = None) -> list[int]:
    """2, half the host's cores and all of them (at least 2): a shard's share on a shared host
    and alone on it."""
    cores = cores or host_cores()
    return sorted({2, max(2, cores // 2), max(2, cores)})


def update_threads_table(timeout_s: float = 120.0) -> list[dict]:
    """Every size on one thread (the yardstick), then in each mode on each thread count
    (thread_counts): a process for each mode and count, one after the other; the rows by size."""
    from ps.shard.optim import compiled_sgd

    modes = MODES if compiled_sgd() is not None else tuple(m for m in MODES if m != "kernel")
    cases = [("torch", 1)] + [(mode, t) for t in thread_counts() for mode in modes]
    rows = []
    for mode, threads in cases:
        done = subprocess.run([sys.executable, "-m", "experiments.bench.update_threads", mode, str(threads)],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"psar bench: the update rows {mode} x{threads} failed: {done.stderr.strip()[-500:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["bytes"])  # stable: each size's rows in the order they ran


def format_update_threads_table(rows: list[dict]) -> str:
    gap = rows[0]["gap_s"] * 1e3 if rows else UPDATE_GAP_S * 1e3
    lines = [f"a shard's update: SGD on one key every {gap:g} ms, on torch's intra-op threads (which spin after "
             "each kernel), on the shard's own threads (torch on one; a key of 8 MiB or more split over them, "
             "at most one slice a 4 MiB) or in its compiled kernel (a key of 3 MiB or more split over the kernel's "
             "threads): the median update, the slices or threads it took, and the cores the process held over "
             "the run",
             f"{'size':>8} {'threads':>8} {'mode':>7} {'slices':>7} {'update(us)':>11} {'cores held':>11}"]
    for r in rows:
        pieces = "-" if r.get("slices") is None else str(r["slices"])
        lines.append(f"{size_label(r['bytes']):>8} {r['threads']:>8} {r['mode']:>7} {pieces:>7} "
                     f"{r['update_us']:>11.1f} {r['cores']:>11.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    for size in UPDATE_SIZES:
        print(json.dumps(one_row(sys.argv[1], int(sys.argv[2]), size)), flush=True)
