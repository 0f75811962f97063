"""The parameter-server engine's buckets: gradient hooks hand each parameter's keys to a
bucket, which leaves as one message per shard once it holds ps.bucket_kb (or backward is
done), even between the keys of one parameter; under sync the message asks for the keys'
next values too (push+pull), under compress.method its keys leave compressed with this
worker's error feedback. A mixin of ps.engine.PSEngine, whose fields it reads: layout,
client, config, mode, _named, _tables, _bucket*, _pushes, _pulls, _returned, _want,
_summed, _forward, compressor, memory, _began and _released (when the buckets that each
gradient filled were pushed, since backward began, and their bytes)."""

from __future__ import annotations

import time

import torch

from .codec import Packed


class Buckets:
    def _enqueue(self, index: int, param: torch.nn.Parameter) -> None:
        step = None if self.mode == "sync" else self._pushes_made  # sync: each shard's own version
        keys = self.layout.param_keys(index)
        if index in self._tables:
            grads = self._row_grads(index, param.grad)
        else:
            flat = param.grad.detach().reshape(-1)
            if index in self._summed:  # Downpour: the gradients since the last push, with this one
                flat = self._summed.pop(index).add_(flat)
            grads = {k.id: flat[k.offset: k.offset + k.numel] for k in keys}
            if self.compressor is not None:
                grads = {k: self._compress(k, g) for k, g in grads.items()}
        # The chunks leave without a copy: param.grad stays untouched until step() waits.
        if self.mode == "sync":
            for k in keys:
                self._want[k.shard] = self.client.versions.get(k.shard, 0) + 1
        # Key by key: a message leaves once it holds ps.bucket_kb, even between the keys of one
        # parameter, so that a shard can answer its first pieces while later ones arrive.
        name, cap, dense = self._named[index][0], self.config.bucket_kb * 1024, index not in self._tables
        first = len(self._released)
        for k, g in grads.items():
            if not self._bucket_names or self._bucket_names[-1] != name:
                self._bucket_names.append(name)
            self._bucket[k] = g
            if dense:
                self._bucket_dense.append(k)
            self._bucket_bytes += g[0].nbytes + g[1].nbytes if isinstance(g, tuple) else \
                sum(f.nbytes for f in g.frames) if isinstance(g, Packed) else g.nbytes
            if self._bucket_bytes >= cap:
                self._flush(step)
        self._ready += 1
        if self._ready == len(self._named):  # backward is done: what is left leaves
            self._flush(step)
        if len(self._released) - first > 1:  # the buckets one gradient filled: one entry of the record
            self._released[first:] = [[self._released[-1][0], sum(size for _, size in self._released[first:])]]

    def _compress(self, k: int, grad: torch.Tensor):
        """Key k's gradient plus this worker's residual, compressed; the residual becomes
        what the message left out."""
        start = time.perf_counter()
        codec, grad = self.client.codec, grad.cpu()
        compensated = self.memory.compensate(k, grad) if self.memory is not None else grad
        packed = codec.compress(k, compensated, self._step, self.rank)
        if self.memory is not None:
            self.memory.remember(k, compensated, codec.decompress(k, packed.frames, packed.meta))
        self.compress_s += time.perf_counter() - start
        return packed

    def _flush(self, step: int | None) -> None:
        """Push the bucket (one message per shard); under sync the same message asks for its
        keys' next values (push+pull), or, where the bucket holds rows, a pull right behind it."""
        if not self._bucket:
            return
        self._released.append([round(time.perf_counter() - self._began, 6), self._bucket_bytes])
        name = "+".join(self._bucket_names) if len(self._bucket_names) < 4 else \
            f"{self._bucket_names[0]}..{self._bucket_names[-1]} ({len(self._bucket_names)} parameters)"
        # no rows: the push asks for the values itself (Downpour: on the steps that fetch)
        whole = len(self._bucket_dense) == len(self._bucket) and self._fetching()
        if self.clip_mode:  # the shards hold the update until the pull brings the clip's scale
            self._pushes.append((name, time.time(), self.client.push(step, None, self._bucket, lr=self._lr(),
                                                                     hold=True)))
        elif whole and not self._phased:
            # sync: the keys' next values; async and ssp: their values once this push is applied
            # (ssp: once the clock is within the bound), so that they come back while later
            # pieces are pushed instead of in one pull after the last.
            ask = {"next_version": True} if self.mode == "sync" else {"clock": self._pushes_made + 1}
            if self.mode == "sync" and self.config.order == "forward":  # the first layers' keys first
                ask["priority"] = min(self._bucket)
            handle = self.client.push(step, None, self._bucket, pull=True, lr=self._lr(), **ask)
            self._pushes.append((name, time.time(), handle))
            self._returned.update(self._bucket_dense)
            if self._forward is not None:
                self._forward.carry(handle, list(self._bucket))
        else:
            self._pushes.append((name, time.time(), self.client.push(step, None, self._bucket, lr=self._lr())))
            if self.mode == "sync" and self._bucket_dense and not self._phased:
                self._pulls.append((name, time.time(), self.client.pull(self._bucket_dense, next_version=True)))
        self._bucket, self._bucket_names, self._bucket_dense, self._bucket_bytes = {}, [], [], 0
