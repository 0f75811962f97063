"""experiments/rundir/memory.py: a worker's bytes by kind, each storage counted once, and the
most over every rank's records."""

import torch

from experiments.rundir.memory import KEYS, MemoryPeaks, largest, nbytes


def test_views_and_tied_weights_count_once_and_distinct_slices_add_up():
    flat = torch.zeros(10, dtype=torch.float64)
    a, b = flat[:4], flat[4:]
    assert nbytes([a, b]) == 80 and nbytes([a, a, flat[:4]]) == 32
    head = torch.nn.Linear(3, 5, bias=False)
    embed = torch.nn.Embedding(5, 3)
    head.weight = embed.weight
    assert nbytes(list(embed.parameters()) + list(head.parameters())) == 5 * 3 * 4
    rows = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 3), (5, 3))
    assert nbytes([rows]) == 2 * 3 * 4 + 2 * 8  # a row-sparse gradient: its rows and their ids


def test_peaks_grow_and_are_told_once():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())

    class Engine:
        optimizer = opt

    peaks = MemoryPeaks(Engine())
    model(torch.ones(1, 4)).sum().backward()
    peaks.before_step(model)
    opt.step()
    peaks.after_step(model)
    first = peaks.changed()
    assert first == {"params": 40, "grads": 40, "optimizer": 2 * 40 + 2 * 4, "comm_buffers": 0}
    opt.zero_grad(set_to_none=True)
    peaks.before_step(model)
    peaks.after_step(model)
    assert peaks.changed() is None  # nothing grew: the record says nothing
    assert largest([{"memory": first}, {"memory": dict(first, grads=99)}, {"step": 3}]) == dict(first, grads=99)
    assert largest([{"step": 1}]) is None and set(first) == set(KEYS)
