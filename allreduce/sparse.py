"""Row-sparse embedding gradients moved by all-gather, as Horovod moves sparse tensors.

An embedding table's gradient is non-zero only on the rows a batch looked up. Instead of
all-reducing the whole table, each rank all-gathers the ids and rows it touched and sets the
table's gradient to their sum over ranks divided by the world: a sparse tensor, which SGD
without momentum and Adagrad apply to those rows only. The tables' gradients are never
densified, on the wire or in memory.

All-gather needs the same size from every rank, so the row counts travel first and ids and
rows are padded to the largest. The gathers run at step time, after the buckets, so every
rank issues its collectives in one order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .compression import wire_dtype


def gather_counts(counts: list[int], world: int, device: torch.device) -> torch.Tensor:
    """(world, tables) int64: every rank's row count of every table (one all-gather)."""
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return torch.stack(out).cpu()


def gather_rows(ids: torch.Tensor, rows: torch.Tensor, counts: list[int],
                wire: torch.dtype | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """All-gather this rank's (ids, rows) given every rank's row count: ([ids of rank r],
    [rows of rank r], bytes this rank sent); rows travel in `wire` if given, and come back in
    `rows`' dtype. Collective: every rank must call it with the same `counts`."""
    world, most = len(counts), max(counts)
    if most == 0:
        return [ids[:0]] * world, [rows[:0]] * world, 0
    n, dim = rows.shape
    padded_ids = ids.new_zeros(most)
    padded_ids[:n] = ids
    padded_rows = rows.new_zeros((most, dim), dtype=wire or rows.dtype)
    padded_rows[:n] = rows
    all_ids = [torch.empty_like(padded_ids) for _ in range(world)]
    all_rows = [torch.empty_like(padded_rows) for _ in range(world)]
    dist.all_gather(all_ids, padded_ids)
    dist.all_gather(all_rows, padded_rows)
    nbytes = (world - 1) * (padded_ids.nbytes + padded_rows.nbytes)  # ring all-gather: N-1 chunks out
    return ([i[:c] for i, c in zip(all_ids, counts)],
            [r[:c].to(rows.dtype) for r, c in zip(all_rows, counts)], nbytes)


def merge_rows(ids: list[torch.Tensor], rows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The coalesced sparse (rows, dim) tensor summing every rank's rows: an id that several
    ranks touched gets the sum of their rows; a rank with none adds nothing."""
    indices = torch.cat(ids).unsqueeze(0)
    values = torch.cat(rows)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False).coalesce()


def local_rows(grad: torch.Tensor | None, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids sorted unique, summed rows) of this rank's sparse gradient; none for no gradient."""
    if grad is None:
        return (torch.empty(0, dtype=torch.int64, device=param.device),
                param.new_empty((0, param.shape[1])))
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


class SparseAllGather:
    """Owns the row-sparse embedding tables of one model replica.

    Args:
        tables: {parameter name: nn.Embedding or nn.EmbeddingBag} whose weights are moved by
            all-gather; the modules are switched to sparse gradients here.
        world: number of ranks the gradient is averaged over.
        compression: 'none', 'fp16' or 'bf16': the dtype the rows travel in (ids stay int64;
            rows are averaged before the cast, and summed in the table's dtype).
    """

    def __init__(self, tables: dict[str, torch.nn.Module], world: int,
                 compression: str = "none") -> None:
        self.world = world
        self.names = list(tables)
        self.params = [m.weight for m in tables.values()]
        self._wire = [wire_dtype(compression, p.dtype) for p in self.params]
        for module in tables.values():
            module.sparse = True  # autograd makes a (rows, dim) sparse gradient, never a dense one

    def reduce(self) -> int:
        """Set each table's gradient to the sum of every rank's rows over the world, sparse
        and coalesced; return the bytes this rank sent (and received). A synchronisation point."""
        if not self.params:
            return 0
        mine = []
        for name, p in zip(self.names, self.params):
            if p.grad is not None and not p.grad.is_sparse:
                raise RuntimeError(f"{name} got a dense gradient; allreduce.sparse=allgather needs "
                                   "the table's module to be its only user")
            mine.append(local_rows(p.grad, p))
        counts = gather_counts([len(ids) for ids, _ in mine], self.world, self.params[0].device)
        nbytes = (self.world - 1) * counts.shape[1] * 8
        for t, (p, (ids, rows)) in enumerate(zip(self.params, mine)):
            # Averaged before the cast, as the buckets are, so fp16 cannot overflow on the sum.
            all_ids, all_rows, sent = gather_rows(ids, rows / self.world, counts[:, t].tolist(),
                                                  self._wire[t])
            p.grad = merge_rows(all_ids, all_rows, p.shape)
            nbytes += sent
        return nbytes

    def zero_grad(self) -> None:
        """Drop the sparse gradients, so that the next step's do not add to them."""
        for p in self.params:
            p.grad = None
