"""Elastic averaging SGD (EASGD, Zhang, Choromanska and LeCun 2015, asynchronous form) on the
parameter-server shards: the engine ps-easgd.

Each worker keeps its own model x_i and steps its own optimizer (the experiment's) on its own
gradients; the shards hold the centre x~, sharded like any parameter. Every tau steps a worker
fetches the centre and moves both towards each other by the elastic difference

    d = alpha * (x_i - x~);    x_i <- x_i - d;    x~ <- x~ + d   (a push of -d)

The shards apply pushes on arrival (the async rule) with plain SGD at learning rate 1 and no
1/N scaling, so a push of -d adds d to the centre. The run's model (model.pt, the evaluation)
is the centre, read by worker 0 once every worker has left.
"""

from __future__ import annotations

import time

import torch

from .config import PSConfig
from .engine import PSEngine

SHARD_LR = 1.0
"""The shards' SGD learning rate: a push of -d adds d to the centre."""


def shard_optimizer(params) -> torch.optim.Optimizer:
    """What the shards of ps-easgd update the centre with."""
    return torch.optim.SGD(params, lr=SHARD_LR)


class EASGDEngine(PSEngine):
    """ps-easgd on the worker side: local steps, and an elastic exchange every
    config.easgd_tau steps with moving rate config.easgd_alpha (checked by PSConfig)."""

    values_on_shards = False  # each worker's model is its own; the shards hold the centre

    def __init__(self, rank: int, world: int, device: torch.device, addresses: list[str], config: PSConfig,
                 **kwargs) -> None:
        super().__init__(rank, world, device, addresses, "async", config, **kwargs)
        self.alpha, self.tau = config.easgd_alpha, config.easgd_tau
        self.exchanges = 0

    def attach(self, model: torch.nn.Module, make_optimizer) -> torch.nn.Module:
        model = super().attach(model, make_optimizer)
        if self._tables:
            raise RuntimeError("ps-easgd ties whole parameters to the centre; the shards hold tables by rows: "
                               "set ps.sparse=dense")
        for hook in self._hooks:  # gradients never leave: the worker steps on them itself
            hook.remove()
        self._hooks = []
        self._optimizer = make_optimizer([p for _, p in self._named])
        return model

    def _refuse_state(self, call: str, loading: bool) -> None:
        raise NotImplementedError(f"{call} under ps-easgd: each worker's model and optimizer are its own and the "
                                  "centre is the shards', so no one worker's checkpoint is the run's state")

    def allow_clip(self) -> None:
        pass  # torch's own clip_grad_norm_ acts on this worker's gradient, which never leaves

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for _, p in self._named], max_norm, norm_type)

    def step(self) -> dict:
        self._step_own()
        for _, p in self._named:
            p.grad = None
        if self.schedule is not None:
            self.schedule.step()
        comm_s = 0.0
        self._step += 1
        if self._step % self.tau == 0:
            began = time.perf_counter()
            self._exchange()
            comm_s = time.perf_counter() - began
        return {"comm_s": comm_s, **self._traffic()}

    def _exchange(self) -> None:
        """Fetch the centre, move this worker's model and the centre towards each other."""
        started = time.time()
        centre = self.client.wait(self.client.pull(self._dense_keys)).values
        pushes = {}
        with torch.no_grad():
            for kid in self._dense_keys:
                key = self.layout.keys[kid]
                mine = self._named[key.param][1].view(-1)[key.offset: key.offset + key.numel]
                d = (mine - centre[kid].to(mine.dtype)).mul_(self.alpha)
                mine.sub_(d)
                pushes[kid] = d.neg_().cpu()  # the shards' SGD at lr 1 adds d
        self.client.wait(self.client.push(self.exchanges, None, pushes))
        self.exchanges += 1
        if self.trace is not None:
            self.trace("elastic exchange", started, time.time(), thread="push")
