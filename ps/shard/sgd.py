"""torch.optim.SGD's single-tensor loop (torch/optim/sgd.py), op for op: the arithmetic a
shard replays where its optimizer is torch's SGD (ps.shard.optim.sgd_step), and the reference
the compiled kernel is checked against (ps.shard.compiled.arithmetic_matches)."""

from __future__ import annotations

import torch


def sgd_ops(p: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, h: tuple, fill: bool = False):
    """SGD's ops (torch's single-tensor loop) on p, a key or a slice of one, with its gradient
    and its momentum buffer buf over the same span (None: none yet, and a clone of the
    gradient is made); h: (lr, weight_decay, maximize, momentum, dampening, nesterov). fill:
    buf is a first one, to be filled from the gradient. Returns the momentum buffer."""
    lr, weight_decay, maximize, momentum, dampening, nesterov = h
    if maximize:
        grad = -grad
    if weight_decay != 0:
        grad = grad.add(p, alpha=weight_decay)
    if momentum != 0:
        if buf is None:
            buf = grad.detach().clone()
        elif fill:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        grad = grad.add(buf, alpha=momentum) if nesterov else buf
    p.add_(grad, alpha=-lr)
    return buf
