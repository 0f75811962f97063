"""The parameter-server engine's embedding tables moved by rows (ps.sparse=rows): a table's
sparse gradient pushed as the rows a batch touched, per key, and the rows a lookup reads
pulled before it (or prefetched after backward, where the loop announces them). A mixin of
ps.engine.PSEngine, whose fields it reads: layout, client, _named, _tables, _step, _want,
_prefetched, row_pulls, trace."""

from __future__ import annotations

import time

import torch

from .layout import ROW_MODULES


class RowTables:
    def _table_module(self, model: torch.nn.Module, index: int) -> torch.nn.Module:
        name, param = self._named[index]
        owner = model.get_submodule(name.rpartition(".")[0])
        if not isinstance(owner, ROW_MODULES) or owner.weight is not param:
            raise RuntimeError(f"the shards hold {name!r} by rows, but it is not the weight of an "
                               f"Embedding or EmbeddingBag in this worker's model")
        return owner

    def _row_grads(self, index: int, grad: torch.Tensor) -> dict:
        """{key: (row ids within the key, summed rows)} of a table's sparse gradient; every key
        of the table is pushed, with no rows where the batch touched none (a sync shard
        counts a worker in once it pushed every key)."""
        if not grad.is_sparse:
            raise RuntimeError(f"{self._named[index][0]}: expected a sparse gradient from its lookup")
        grad = grad.coalesce()
        ids, rows = grad.indices()[0], grad.values()
        out = {}
        for key, (lo, hi) in self._key_spans(index, ids):
            first = self.layout.key_rows(key)[0]
            out[key.id] = (ids[lo:hi] - first, rows[lo:hi])
        return out

    def _key_spans(self, index: int, ids: torch.Tensor):
        """(key, (lo, hi)) for each key of table `index`: ids[lo:hi] are its rows (ids sorted)."""
        keys = self.layout.param_keys(index)
        starts = torch.tensor([self.layout.key_rows(k)[0] for k in keys] + [self.layout.specs[index].shape[0]],
                              device=ids.device)
        bounds = torch.searchsorted(ids, starts).tolist()
        return [(k, (bounds[j], bounds[j + 1])) for j, k in enumerate(keys)]

    def prefetch(self, rows: dict[str, torch.Tensor]) -> None:
        """Ask now for the rows the next batch will look up ({table parameter name: ids}), so
        that they come back while this step ends (under sync: as soon as its update is done);
        the next forward then uses them instead of asking. Called after backward."""
        index_of = {self._named[i][0]: i for i in self._tables}
        for name, ids in rows.items():
            if name in index_of:
                i = index_of[name]
                self._prefetched[i] = self._ask_rows(i, torch.unique(ids.detach().reshape(-1)), self._step + 1)

    def _ask_rows(self, index: int, ids: torch.Tensor, step: int) -> tuple:
        """Send the pull of rows `ids` (sorted, unique) of table `index` for step `step`."""
        spans = self._key_spans(index, ids)
        rows = {key.id: ids[lo:hi] - self.layout.key_rows(key)[0] for key, (lo, hi) in spans}
        started = time.time()
        if self.mode == "sync":
            h = self.client.pull(None, rows=rows, min_version={k.shard: self._want.get(k.shard, 0) for k, _ in spans})
        else:
            h = self.client.pull(None, rows=rows, clock=step if self.mode == "ssp" else None)
        return ids, spans, h, started

    def _pull_rows(self, index: int, module: torch.nn.Module, args: tuple) -> None:
        """Forward pre-hook of a table: pull the rows this lookup reads (unless prefetched),
        then let it run."""
        ids = torch.unique(args[0].detach().reshape(-1))  # sorted
        asked = self._prefetched.pop(index, None)
        if asked is not None and not torch.equal(asked[0], ids):  # another batch than announced
            self.client.wait(asked[2])
            asked = None
        prefetched = asked is not None
        self.row_pulls["prefetched" if prefetched else "at_lookup"] += 1
        ids, spans, h, started = asked or self._ask_rows(index, ids, self._step)
        result = self.client.wait(h)
        weight = module.weight
        with torch.no_grad():
            for key, _ in spans:
                got = result.ids[key.id]
                if got.numel():
                    values = result.values[key.id].to(device=weight.device, dtype=weight.dtype)
                    weight.index_copy_(0, got.to(weight.device) + self.layout.key_rows(key)[0], values)
        if self.trace is not None:
            self.trace(f"pull rows {self._named[index][0]}", started, h.done_at, thread="pull",
                       rows=int(ids.numel()), prefetched=prefetched)
