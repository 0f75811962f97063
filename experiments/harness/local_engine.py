"""One process that computes the gradient of every shard and averages them: the reference.

It sees exactly the data the N workers would see, so its parameters after K steps are what
every distributed engine must reproduce. BatchNorm statistics follow shard 0, as on rank 0
of the distributed engines (whose buffers are broadcast from rank 0).
"""

from __future__ import annotations

import torch


class LocalEngine:
    def __init__(self, world: int) -> None:
        self.world = world
        self.shards = list(range(world))
        self._micro = 0

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        self._buffers = list(model.buffers())
        self._kept: list[torch.Tensor] = []
        self.optimizer = make_optimizer(self._params)
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        # Forward already updated the buffers; keep shard 0's update and undo the others'.
        with torch.no_grad():
            if self._micro == 0:
                self._kept = [b.clone() for b in self._buffers]
            else:
                for b, kept in zip(self._buffers, self._kept):
                    b.copy_(kept)
        self._micro += 1

    def step(self) -> dict[str, float]:
        if self._micro != self.world:
            raise RuntimeError(f"step() after {self._micro} backward calls; expected {self.world}")
        with torch.no_grad():
            for name, p in self._named:
                if p.grad is None:
                    raise RuntimeError(f"parameter {name!r} got no gradient in this step")
                p.grad.div_(self.world)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._micro = 0
        return {"comm_s": 0.0, "bytes_sent": 0, "bytes_recv": 0}

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        pass
