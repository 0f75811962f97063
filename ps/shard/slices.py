"""A shard's update of a large key on several cores, on threads that sleep between updates.

torch's intra-op threads (OpenMP) split a large kernel over a process's cores too, but each
of them spins after every kernel, waiting for the next one. Measured here (torch 2.13, 2
threads, an add of 1 MiB followed by a sleep): each update cost 9 to 11 ms of CPU on the
second thread afterwards, so a process updating a key every 1 or 5 ms held 1.09 and 1.03
cores where one thread held 0.10 and 0.03; with OMP_WAIT_POLICY=PASSIVE, 0.11 and 0.03. A
shard waits on its sockets most of the time, and the cores its spinning threads hold are the
ones its host's other processes need (ZeroMQ's I/O threads, workers, the emulated links);
a process forked from the launcher's zygote cannot take OMP_WAIT_POLICY (libgomp reads it
when torch loads), and the ranks, whose kernels follow one another, are faster spinning (a
forward and backward of a 3-layer MLP on 2 threads: 21 to 24 ms spinning, 28 to 34 passive).

So a shard whose optimizer's step is elementwise (SGD, whose arithmetic it runs itself,
ps.shard.optim.sgd_step; Adam, AdamW and Adagrad, whose own step it runs on each slice with
the slices of the key's state) keeps torch on one thread and splits a key of at least
2 * MIN_SLICE_BYTES into slices, one a thread of its own (SlicePool), which block on a queue
between updates. SGD's compiled kernel, where it is built, splits a key of 3 MiB or more over
threads of its own instead (ps/shard/_split.h: a hand-off there costs a futex's wake, not a
queue's and the GIL's); SGD comes here for what it does not take (a first momentum buffer). A slice's values are the whole key's bit for bit (tests/unit/test_slices.py).
Other optimizers keep torch's threads.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

try:  # the caller's floating-point controls go with each slice (ps/shard/_split.h)
    from ps.shard._compiled import fp_controls, set_fp_controls
except ImportError:  # not built: each thread keeps its own
    fp_controls = set_fp_controls = None

MIN_SLICE_BYTES = 4 << 20
"""A slice's least size. Handing a slice to another thread costs 40 to 80 us on this 2-core
machine (a 1 MiB add: 44 us on one thread, 81 us split in two; 4 MiB 160 against 213; 16 MiB
1024 against 793), and a slice of 4 MiB takes about 160 us."""
ALIGN = 64
"""Slices start at multiples of this many elements: whole vectors of any width torch uses."""


class SlicePool:
    """`threads` threads for one key's update (the caller's own among them): run(fn, cuts)
    calls fn(start, end) for each slice, the last on the caller's thread. The other threads
    start with the first key large enough to split and sleep on a queue between slices. One
    caller at a time (a shard's serve loop); a run that raises has still waited for every
    slice, but slices that succeeded beside one that failed have written their part. Each
    slice runs under the caller's floating-point controls (flush-to-zero, rounding), where
    the compiled module is built: a thread's are its own, and torch.set_flush_denormal on the
    caller's would otherwise give other bits on the pool's."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"a slice pool needs at least 1 thread, got {threads}")
        self.threads = threads
        self._queues: list[queue.SimpleQueue] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []

    def cuts(self, numel: int, element_size: int) -> list[int]:
        """Where the slices of a key of numel elements begin, and its end: [0, numel] for a key
        too small to split (under 2 * MIN_SLICE_BYTES) or a pool of one thread."""
        pieces = min(self.threads, numel * element_size // MIN_SLICE_BYTES)
        if pieces < 2:
            return [0, numel]
        step = -(-numel // pieces // ALIGN) * ALIGN
        return sorted({min(numel, i * step) for i in range(pieces)} | {numel})

    def run(self, fn: Callable[[int, int], None], cuts: list[int]) -> None:
        """fn(cuts[i], cuts[i + 1]) for each slice, at once; returns when every one has, and
        raises the first error any of them raised."""
        jobs = list(zip(cuts, cuts[1:]))
        if len(jobs) > self.threads:
            raise ValueError(f"{len(jobs)} slices for a pool of {self.threads} threads")
        self._start(len(jobs) - 1)
        controls = fp_controls() if fp_controls is not None else None
        for q, (a, b) in zip(self._queues, jobs[:-1]):
            q.put((fn, a, b, controls))
        error: BaseException | None = None
        try:
            fn(*jobs[-1])
        except BaseException as e:  # the others are still to be waited for
            error = e
        for _ in jobs[:-1]:
            failed = self._done.get()
            error = error or failed
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the threads (each finishes its slice first)."""
        for q in self._queues:
            q.put(None)
        for t in self._workers:
            t.join(5)
        self._queues, self._workers = [], []

    def _start(self, count: int) -> None:
        while len(self._queues) < count:
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._serve, args=(q,), name=f"slice {len(self._queues) + 1}", daemon=True)
            t.start()  # a queue is taken only with its thread running
            self._queues.append(q)
            self._workers.append(t)

    def _serve(self, q: queue.SimpleQueue) -> None:
        while (job := q.get()) is not None:
            fn, a, b, controls = job
            try:
                if controls is not None:
                    set_fp_controls(controls)
                fn(a, b)
                self._done.put(None)
            except BaseException as e:  # handed to run, which raises it
                self._done.put(e)
