"""Row-sparse keys on a shard: gradients over some rows, and Hogwild!'s row collisions.

A push of rows (unique, increasing ids validated by ps.protocol) becomes a sparse gradient,
so the optimizer touches only those rows and their state. Under async and ssp a shard counts
row collisions: rows of a push that another worker's push changed after this worker read
them (its gradient was computed on values since overwritten).
"""

from __future__ import annotations

import torch


def grad_of(shape: torch.Size, g: torch.Tensor, ids: torch.Tensor | None, coalesced: bool = True) -> torch.Tensor:
    """A pushed gradient as the optimizer's grad of a chunk of `shape`: dense, or sparse over
    the rows `ids` (which must be coalesced, unless coalesced=False)."""
    if ids is None:
        return g if g.dim() == len(shape) else g.reshape(shape)  # a dense chunk is as flat as its frame
    # The ids were validated on arrival (ps.protocol): torch's own checks would only repeat it.
    grad = torch.sparse_coo_tensor(ids.unsqueeze(0), g, shape, is_coalesced=coalesced, check_invariants=False)
    return grad if coalesced else grad.coalesce()


class RowCollisions:
    """Who last changed each row of the row-sparse chunks, by which update (a counter the
    caller gives), and when each worker last read; count() gives the collisions of a push."""

    def __init__(self, chunks: dict[int, torch.Tensor]) -> None:
        self._writer = {k: torch.full((c.shape[0],), -1, dtype=torch.int32) for k, c in chunks.items() if c.dim() == 2}
        self._update = {k: torch.zeros(len(w), dtype=torch.int64) for k, w in self._writer.items()}
        self._read_at: dict[int, int] = {}  # worker -> the update counter when its last pull was answered

    def read(self, w: int, update: int) -> None:
        """Worker w was sent the values as of update `update`."""
        self._read_at[w] = update

    def count(self, k: int, w: int, ids: torch.Tensor, update: int) -> int:
        """The rows `ids` of key k that another worker's push changed after w last read them;
        marks them as changed by w in update `update` (the one this push makes)."""
        writer, changed = self._writer[k][ids], self._update[k][ids]
        read = self._read_at.get(w, 0)
        collisions = int(((writer >= 0) & (writer != w) & (changed > read)).sum())
        self._writer[k][ids] = w
        self._update[k][ids] = update
        return collisions
