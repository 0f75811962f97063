"""A shard's compiled path for a push+pull of whole dense keys, where the optimizer is torch's
SGD (ps/shard/_compiled.c, built with psar; the sync rule's step in ps/shard/_sync.h).

Python's short path (ps.shard.fastpath) still makes about 90 calls a push+pull, each several
times dearer on a core that has just slept in a poll than in a loop; with nothing done at all
between its receive and its send, the shard's part of a 1 KiB push+pull fell from 201-224 to
35-86 us (docs/results.md). This path is one call: it reads the header's bytes without a dict, checks the keys
against a table built here once, updates the keys' memory with SGD's arithmetic, counts and
notes on the shard's own objects what the Python paths do, and writes the reply's header
(requests waiting that the push lets go on, ssp's pulls, it leaves to the shard's _release;
under sync it answers the pulls that waited for the step's last push itself, where they are
all push+pulls' pulls, and hands a pull that waits to the shard's Waiting). Under sync a
push+pull of 4 small keys (quickstart's model, 2 workers, in a loop) takes 17 us where the
Python short path took 72 (async's: 7); quickstart ps-sync x2 ran 2 to 29% faster (six
pairs, median 17%), its shard using two thirds of the CPU (docs/results.md, "A sync step in
the compiled path").
A key a reply still points at it first moves to a copy, as the Python paths do
(SnapshotPool.own). Anything it does not take (another field, a failed check, a pull that
would wait, a key's first step with momentum, which makes its buffer) it leaves, unchanged,
to the Python paths, which say what is wrong: tests/unit/test_shard_fastpath.py holds the
three to the same bytes, parameters and counters.

A key of 3 MiB or more is updated on the shard's threads (set_threads; ShardServer.use_cores):
the caller and threads that sleep between keys take chunks of it in turn (ps/shard/_split.h).

Its arithmetic is torch's single-tensor SGD loop as torch's CPU kernels round it: a multiply
by the async scale, then fused multiply-adds for the weight decay, the momentum buffer (after
its multiply by the momentum) and the update, on the buffer torch's optimizer keeps in its
state (so checkpoints and the Python paths see the same one). Each process
checks that on a probe against torch before using the path (`arithmetic_matches`), and keeps
to Python where a build of torch rounds otherwise. PSAR_COMPILED=0 turns it off (a comparison).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy
import torch

from ps.protocol_schema import _MAX_INT, PROTOCOL_VERSION
from ps.shard.sgd import sgd_ops
from ps.shard.slices import MIN_SLICE_BYTES

try:
    import ps.shard._compiled as _compiled
except ImportError:  # not built (a copy of the tree without `pip install -e .`): Python's paths
    _compiled = None

DTYPES = {"float32": False, "float64": True}
"""The dtypes the compiled path updates: name -> float64."""


def available() -> bool:
    """Whether the compiled module is built and not turned off (PSAR_COMPILED=0)."""
    return _compiled is not None and os.environ.get("PSAR_COMPILED", "1") != "0"


def compiled_path(server: Any, table: dict[int, tuple], wait: Callable[[bytes, list, int], None]) \
        -> Callable[[bytes, list], list | None] | None:
    """The compiled path of server (a ps.shard.ShardServer) over the keys of `table`
    (ps.protocol_short.WholeKeys' table: key -> (dtype name, shape, bytes, torch dtype)), or
    None where it cannot serve this shard: not built, sync with backup workers (a step's late
    pushes dropped), compression, an optimizer other than SGD's replay (ps.shard.optim), or
    torch rounding otherwise than it does. Keys it cannot update itself (another dtype, a key
    large enough to update in slices, a row-sparse parameter's) stay with the Python paths.
    wait(peer, frames, staleness): a sync push+pull's pull that waits, once its push is taken
    (ps.shard.fastpath)."""
    rule = server.rule.name
    if not available() or rule not in ("async", "ssp", "sync") or rule == "sync" and server.config.backup_workers \
            or server.codec is not None or server.pulls is not None or server.config.wire_dtype \
            or not server.optimizer._sgd or not arithmetic_matches():
        return None
    keys = [(k, nbytes, DTYPES[dtype], dtype, shape[0]) for k, (dtype, shape, nbytes, _) in sorted(table.items())
            if dtype in DTYPES and len(shape) == 1 and nbytes < 2 * MIN_SLICE_BYTES and k not in server.sparse_keys]
    if not keys:
        return None
    limits = server._dispatch.limits
    dtypes = {k: torch_dtype for k, (_, _, _, torch_dtype) in table.items()}

    def tensor_of(frame: memoryview, k: int) -> torch.Tensor:
        """A sync step's first gradient of key k, on its frame (as ps.protocol_short's WholeKeys.tensors)."""
        return torch.frombuffer(frame, dtype=dtypes[k])

    return _compiled.Path(server, keys, buffer_bytes, rule == "ssp", server.config.async_scale == "mean",
                          server.config.staleness, PROTOCOL_VERSION, _MAX_INT, limits.max_header_bytes,
                          limits.max_keys, limits.max_str_len, limits.max_map_len, server.num_workers,
                          len(server.keys), rule == "sync", tensor_of, wait)


SPLIT_MIN_BYTES = _compiled.SPLIT_MIN_BYTES if _compiled is not None else None
"""The least key the kernel splits over its threads (3 MiB; None: not built)."""


def set_threads(threads: int) -> None:
    """Update a key of SPLIT_MIN_BYTES or more on `threads` threads (the caller's among them; at
    most 64), in chunks the caller and threads of the kernel's own take in turn
    (ps/shard/_split.h): the same bits as on one. Process-wide; where the module is not built,
    nothing."""
    if _compiled is not None:
        _compiled.set_threads(threads)


def buffer_bytes(t: Any, nbytes: int, dtype: str) -> Any:
    """A writable numpy view of the bytes of t, a key's momentum buffer as torch's SGD keeps it,
    if it is one this path updates (a dense CPU tensor of the key's dtype and bytes); None."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided \
            or str(t.dtype).removeprefix("torch.") != dtype or not t.is_contiguous() \
            or t.numel() * t.element_size() != nbytes or t.requires_grad:
        return None
    return t.detach().numpy().view(numpy.uint8)


def fused_sgd(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, h: tuple, divisor: int = 1) -> bool:
    """SGD's step (ps.shard.sgd.sgd_ops; h: lr, weight_decay, maximize, momentum, dampening,
    nesterov) on p with grad divided by divisor first, in one pass of the compiled arithmetic,
    where the three are dense CPU tensors of one float dtype and size and the momentum buffer
    exists (a first one is torch's to make): whether it took them. Where torch runs a sync
    step's mean and momentum SGD as four passes over a key (the division, the buffer's
    multiply and add, the update), this is one. Call it only where arithmetic_matches()."""
    lr, weight_decay, maximize, momentum, dampening, nesterov = h
    if (momentum != 0) != (buf is not None) or p.dtype not in _FLOATS or grad.dtype is not p.dtype \
            or (buf is not None and buf.dtype is not p.dtype) or isinstance(lr, torch.Tensor):
        return False
    try:  # numpy() refuses another device, a sparse layout, a negated view or one that needs grad; sgd, buffers of
        # other sizes or strides, or sharing memory
        _compiled.sgd(p.numpy(), grad.numpy(), None if buf is None else buf.numpy(),
                      p.dtype is torch.float64, lr, weight_decay, maximize, 1.0, momentum, dampening, nesterov,
                      divisor)
    except (TypeError, RuntimeError, ValueError, BufferError):
        return False  # nothing written: sgd checks every buffer before it writes
    return True


_FLOATS = (torch.float32, torch.float64)


PROBE_SIZES = (1, 8, 15, 17, 31, 1027)
"""Sizes of the probe: runs shorter than a vector, whole vectors, tails of 1, 3, 7 and 15
elements behind them (8 float32 or 4 float64 lanes, unrolled), and a long run."""


def arithmetic_matches() -> bool:
    """Whether the compiled SGD update leaves the bits torch's (the replay, ps.shard.sgd.sgd_ops,
    which tests/unit/test_shard_optim.py holds to torch.optim.SGD) does, in float32 and float64,
    with and without a scale, a divisor (a sync step's mean), weight decay, maximize and
    momentum. Checked once a process."""
    global _MATCHES
    if _MATCHES is None:
        _MATCHES = _compiled is not None and all(_probe(draws, n, case) for draws in map(_draws, _FLOATS)
                                                 for n in PROBE_SIZES for case in _CASES)
    return _MATCHES


_MATCHES: bool | None = None
_CASES = [(0.0137, weight_decay, maximize, scale, momentum, dampening, nesterov, divisor)
          for maximize, scale, divisor in ((False, 1.0, 1), (True, 1.0, 1), (False, 1.0 / 3, 1), (True, 1.0 / 3, 1),
                                           (False, 1.0, 3), (True, 1.0, 7))
          for weight_decay in (0.0, 0.003)
          for momentum, dampening, nesterov in ((0.0, 0.0, False), (0.9, 0.1, False), (0.9, 0.0, True))]
"""(lr, weight_decay, maximize, scale, momentum, dampening, nesterov, divisor): every loop of the
kernel (ps/shard/_sgd.h: none, a scale or a divisor, each with and without maximize, which
folds into them; with and without weight decay; no momentum, momentum, nesterov)."""


def _draws(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The probe's values, gradients and first gradients (for a momentum buffer) of dtype, of
    the largest size: each probe takes the first n of them (drawn once, not for each case)."""
    gen = torch.Generator().manual_seed(0)
    n = max(PROBE_SIZES)
    return torch.randn(n, generator=gen, dtype=dtype), torch.randn(n, generator=gen, dtype=dtype) * 3, \
        torch.randn(n, generator=gen, dtype=dtype)


def _probe(draws: tuple[torch.Tensor, ...], n: int, case: tuple) -> bool:
    """A step of the compiled arithmetic against the replay's (with momentum: a second step, on
    the buffer the first made), bit for bit, values and buffer."""
    lr, weight_decay, maximize, scale, momentum, dampening, nesterov, divisor = case
    values, g, first = (t[:n] for t in draws)
    h = (lr, weight_decay, maximize, momentum, dampening, nesterov)
    p = values.clone()
    buf = sgd_ops(p, first, None, h) if momentum else None
    expected, got = p.clone(), p.clone()
    expected_buf, got_buf = (buf.clone(), buf.clone()) if buf is not None else (None, None)
    given = g.div(divisor) if divisor != 1 else g
    sgd_ops(expected, given * scale if scale != 1.0 else given, expected_buf, h)
    _compiled.sgd(got.numpy(), g.numpy(), got_buf.numpy() if got_buf is not None else None,
                  g.dtype is torch.float64, lr, weight_decay, maximize, scale, momentum, dampening, nesterov, divisor)
    same = got.numpy().tobytes() == expected.numpy().tobytes()
    return same and (buf is None or got_buf.numpy().tobytes() == expected_buf.numpy().tobytes())
