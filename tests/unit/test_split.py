"""The compiled SGD of a large key split over threads of the kernel's own (ps/shard/_split.h):
the same bits as on one thread, float32 and float64, with and without momentum, at sizes
around its chunks and its threshold; its helpers take part; two callers at once, and a forked
child, still get the whole key's bits."""

from __future__ import annotations

import os
import select
import signal
import threading

import numpy
import pytest
import torch

import ps.shard.compiled as compiled
from ps.shard.compiled import _compiled



def _splits() -> bool:
    """Whether this build splits (Linux: futexes), left at one thread."""
    if not compiled.available():
        return False
    compiled.set_threads(2)
    splits = _compiled.threads() == 2
    compiled.set_threads(1)
    return splits


pytestmark = [pytest.mark.skipif(not _splits(), reason="the compiled module is not built, or splits on no threads here"),
              pytest.mark.usefixtures("kernel_threads")]

MiB = 1 << 20
CHUNK = 256 << 10
TRIES = 500
"""Keys of 8 MiB (about 1.5 ms each here) a test splits until a helper has taken part."""


def step(p, g, buf, f64, threads, steps=2):
    """steps of momentum SGD (buf: a buffer, or None) with a divisor, on copies, on `threads`."""
    compiled.set_threads(threads)
    p, buf = p.clone(), None if buf is None else buf.clone()
    for _ in range(steps):
        _compiled.sgd(p.numpy(), g.numpy(), None if buf is None else buf.numpy(), f64, 0.013, 0.002, False, 1.0,
                      0.0 if buf is None else 0.9, 0.1, False, 3.0)
    return p, buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nbytes", [3 * MiB - 8, 3 * MiB, 3 * MiB + CHUNK + 8, 8 * MiB + 24])
@pytest.mark.parametrize("momentum", [False, True])
def test_split_keys_have_one_threads_bits(dtype, nbytes, momentum):
    size = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(nbytes)
    p, g, buf = (torch.randn(nbytes // size, generator=gen, dtype=dtype) for _ in range(3))
    keys = _compiled.split_counts()[0]
    want = step(p, g, buf if momentum else None, dtype is torch.float64, 1)
    assert _compiled.split_counts()[0] == keys  # one thread: nothing split
    for threads in (2, 3, 7):
        got = step(p, g, buf if momentum else None, dtype is torch.float64, threads)
        assert torch.equal(got[0], want[0]) and (not momentum or torch.equal(got[1], want[1])), threads
    assert _compiled.split_counts()[0] - keys == (6 if nbytes >= 3 * MiB else 0)


def test_the_helpers_take_chunks_and_a_small_key_stays_whole():
    p, g = torch.zeros(2 * MiB), torch.ones(2 * MiB)  # 8 MiB float32: 32 chunks
    keys, helped = _compiled.split_counts()
    for tries in range(1, TRIES + 1):  # a helper wakes in about 0.1 ms here, the caller takes 1.5
        step(p, g, None, False, 2, steps=1)
        if _compiled.split_counts()[1] > helped:
            break
    after = _compiled.split_counts()
    assert after[0] - keys == tries and after[1] > helped
    small = torch.zeros(3 * MiB // 4 - 1)
    step(small, torch.ones_like(small), None, False, 2)
    assert _compiled.split_counts()[0] == after[0]


def test_helpers_round_as_the_caller_does_after_it_changed_its_floating_point_controls():
    """Helpers started before the caller flushed denormals to zero take its controls with each
    key: halving denormals flushes them to 0 on every thread, as on the caller's."""
    n = (8 * MiB) // 4
    g, p = numpy.full(n, 1e-39, numpy.float32), numpy.full(n, 3e-39, numpy.float32)

    def update(threads):
        compiled.set_threads(threads)
        q = p.copy()
        _compiled.sgd(q, g, None, False, 0.5, 0.0, False, 1.0, 0.0, 0.0, False)
        return q.view(numpy.uint32)

    update(2)  # the helpers start with the default controls
    helped = _compiled.split_counts()[1]
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero on this CPU")
    try:
        one = update(1)
        assert not one.any()  # 3e-39 - 0.5e-39 flushed to 0
        for _ in range(TRIES):  # until a helper took part (on a loaded host it may wake after the caller is done)
            assert numpy.array_equal(update(2), one)
            if _compiled.split_counts()[1] > helped:
                break
    finally:
        torch.set_flush_denormal(False)
    assert _compiled.split_counts()[1] > helped, f"no helper took a chunk of {TRIES} keys"


def test_two_callers_at_once_each_get_their_keys_bits():
    """A caller that finds the pool busy updates on its own thread."""
    gen = torch.Generator().manual_seed(1)
    keys = [(torch.randn(MiB, generator=gen), torch.randn(MiB, generator=gen)) for _ in range(2)]
    want = [step(p, g, None, False, 1, steps=5)[0] for p, g in keys]
    compiled.set_threads(2)
    got, errors = [None, None], []

    def run(i):
        try:
            got[i] = step(*keys[i], None, False, 2, steps=5)[0]
        except BaseException as e:  # raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_forked_child_makes_its_own_helpers():
    """The parent's helpers are not in a child: it starts its own, and neither hangs. (The
    child uses numpy only: torch's OpenMP threads do not survive a fork either.)"""
    p, g = numpy.zeros(MiB, numpy.float32), numpy.ones(MiB, numpy.float32)

    def update(threads):
        compiled.set_threads(threads)
        q = p.copy()
        _compiled.sgd(q, g, None, False, 0.013, 0.0, False, 1.0, 0.0, 0.0, False)
        return q

    want = update(1)
    update(2)  # the parent's helpers run
    r, w = os.pipe()
    ready = []
    pid = os.fork()
    if pid == 0:  # the child: a split key's bits, and helpers that took part, on the pipe
        ok = 0
        try:
            before = _compiled.split_counts()[1]
            same, tries = True, 0
            while same and tries < TRIES and _compiled.split_counts()[1] == before:
                same, tries = numpy.array_equal(update(2), want), tries + 1
            ok = 1 + same + (_compiled.split_counts()[1] > before)
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 60)
        assert ready, "a forked child's split update did not finish in 60 s"
        assert os.read(r, 1) == bytes([3])
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
