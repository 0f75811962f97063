"""PowerSGD (Vogels et al. 2019), as torch's powerSGD_hook computes it, per tensor.

A tensor is viewed as the matrix M = tensor.view(shape[0], -1), n x m, of rank
r = min(n, m, rank). It is compressed only from step `start_step` on, only if it has two
dimensions or more, and only where torch's rule says it saves bytes:
(n + m) * r * min_compression_rate < n * m. Every other tensor is sent as it is (`compress`
gives a dense message, which adds up), as torch's hook all-reduces it uncompressed.

A compressed tensor needs a reduction between two halves, so it has its own interface, in
three calls per step (every worker, same order of keys not required):

    P  = c.project(M_w, ctx)             # n x r, local: M_w @ orth(Q)
    P_sum = sum of P over workers        # all-reduce (or the server sums)
    P, Q = c.finish(M_w, P_sum, ctx)     # P = orth(P_sum) (a copy), Q = M_w^T P, m x r
    Q_mean = (sum of Q over workers) / N # all-reduce, then divide (torch divides here)
    approx = c.reconstruct(P, Q_mean, ctx, shape)   # P Q_mean^T: the mean's approximation

Wire: n*r then m*r values of the tensor's dtype (`compressed_nbytes`). Warm start: Q_mean is
kept per key and orthogonalized at the next step's project, as torch does. Orthogonalization
is torch's _orthogonalize: Gram-Schmidt for r <= 2, QR beyond, epsilon 0, except that a zero
column stays zero (torch makes it NaN).

Error feedback, as torch: memory.remember(key, M_w, approx) stores the local compensated
matrix minus the approximation of the mean. One departure: psar's harness applies the memory
at every step, also before start_step (dense steps leave residual_w = g_w - mean, which sums
to zero over workers, so the mean is unchanged to rounding), where torch starts the memory
at start_step.

Q's first values: `initial_q(key, m, r, dtype)`, a standard normal draw from a generator
seeded by (seed, key), the same on every worker. torch instead seeds one generator per bucket
from numpy's RandomState(seed) and draws the bucket's Qs in its shape-grouped order, which
depends on DDP's bucket layout; tests replay that rule by overriding initial_q.
"""

from __future__ import annotations

import torch

from experiments.compression.base import Compressor, Context, Message, generator


def orthogonalize(matrix: torch.Tensor) -> None:
    """Orthonormal columns in place, as torch's _orthogonalize on a batch of one (n x r)."""
    batch = matrix.unsqueeze(0)
    rank = batch.shape[2]
    if rank > 2:
        torch.linalg.qr(batch, out=(batch, torch.empty(1, rank, rank, dtype=batch.dtype)))
        return
    for i in range(rank):
        col = batch[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < rank:
            rest = batch[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGD(Compressor):
    name = "powersgd"
    adds_up = True  # P and Q are linear in M for the shared Q and P
    needs_error_feedback = True

    def __init__(self, rank: int = 1, start_step: int = 10, seed: int = 0,
                 min_compression_rate: float = 2):
        self.rank, self.start_step, self.seed = rank, start_step, seed
        self.min_compression_rate = min_compression_rate
        self.q: dict[str | int, torch.Tensor] = {}  # warm start: the last Q_mean per key

    def matrix_rank(self, shape: tuple[int, ...]) -> int:
        n = shape[0]
        return min(n, torch.Size(shape).numel() // n, self.rank)

    def compresses(self, shape: tuple[int, ...], step: int) -> bool:
        """Whether a tensor of this shape goes through project/finish/reconstruct at `step`."""
        if step < self.start_step or len(shape) < 2 or torch.Size(shape).numel() == 0:
            return False
        n, m = shape[0], torch.Size(shape).numel() // shape[0]
        return (n + m) * self.matrix_rank(shape) * self.min_compression_rate < n * m

    def compressed_nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes one worker sends for a compressed tensor in one step: P then Q."""
        n, m = shape[0], torch.Size(shape).numel() // shape[0]
        return (n + m) * self.matrix_rank(shape) * torch.empty(0, dtype=dtype).element_size()

    # Dense path: tensors that are not compressed at this step.
    def compress(self, tensor: torch.Tensor, ctx: Context) -> Message:
        if self.compresses(tuple(tensor.shape), ctx.step):
            raise ValueError(f"powersgd compresses {ctx.key} (shape {tuple(tensor.shape)}) at step "
                             f"{ctx.step}: use project/finish/reconstruct, not compress")
        return Message((tensor,), tuple(tensor.shape), tensor.dtype)

    def decompress(self, message: Message) -> torch.Tensor:
        return message.frames[0].to(message.dtype).view(message.shape)

    # Compressed path.
    def initial_q(self, key: str | int, m: int, r: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(m, r, generator=generator(self.seed, "powersgd-q", key), dtype=dtype)

    def project(self, tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
        matrix = tensor.reshape(tensor.shape[0], -1)
        n, m = matrix.shape
        r = self.matrix_rank(tuple(tensor.shape))
        q = self.q.get(ctx.key)
        if q is None or q.shape != (m, r):
            q = self.initial_q(ctx.key, m, r, matrix.dtype)
        q = q.clone()
        orthogonalize(q)
        return torch.bmm(matrix.unsqueeze(0), q.unsqueeze(0))[0]

    def finish(self, tensor: torch.Tensor, p_sum: torch.Tensor,
               ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        matrix = tensor.reshape(tensor.shape[0], -1)
        p = p_sum.clone()
        orthogonalize(p)
        return p, torch.bmm(matrix.t().unsqueeze(0), p.unsqueeze(0))[0]

    def reconstruct(self, p: torch.Tensor, q_mean: torch.Tensor, ctx: Context,
                    shape: tuple[int, ...]) -> torch.Tensor:
        self.q[ctx.key] = q_mean.clone()
        return torch.bmm(p.unsqueeze(0), q_mean.t().unsqueeze(0))[0].view(shape)
