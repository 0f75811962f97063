"""A user's own training script in place of a named experiment.

The script builds its model, data and optimizer itself; psar only needs to know which
script it is (for the record) and, for the parameter-server engines, which optimizer the
shards must run: that is read off the torch optimizer the script's make_optimizer builds,
since nothing executable crosses the wire.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ps.layout import split_values

from experiments.settings.config import OptimConfig, RunConfig, ScriptConfig, resolve
from experiments.workloads.sparsity import model_layout


def script_config(script: str, args: Sequence[str] = (), overrides: Sequence[str] = (), **fields) -> RunConfig:
    """The RunConfig of a user's script: engine, workers, servers and `--set` overrides as for
    an experiment; the model and data are the script's."""
    base = RunConfig(experiment=f"script:{Path(script).name}", model=ScriptConfig(script, tuple(args)),
                     data=ScriptConfig(script, tuple(args)), steps=1)
    return resolve(base, overrides, **fields)


def _defaults_only(opt: torch.optim.Optimizer, group: dict, **expected: Any) -> None:
    for name, value in expected.items():
        if name in group and group[name] != value:
            raise ValueError(f"{type(opt).__name__}({name}={group[name]!r}): the parameter-server shards "
                             f"run it only with {name}={value!r}")


def optim_config_of(opt: torch.optim.Optimizer) -> OptimConfig:
    """The OptimConfig a shard runs to apply what `opt` would: SGD (momentum, weight decay),
    Adam, AdamW and Adagrad with one parameter group. ValueError naming anything else."""
    if len(opt.param_groups) != 1:
        raise ValueError(f"{type(opt).__name__} has {len(opt.param_groups)} parameter groups; the "
                         "parameter-server shards run one optimizer with one set of settings")
    g = opt.param_groups[0]
    lr = float(g["lr"])
    if type(opt) is torch.optim.SGD:
        _defaults_only(opt, g, dampening=0, nesterov=False, maximize=False)
        return OptimConfig("sgd", lr=lr, momentum=float(g["momentum"]), weight_decay=float(g["weight_decay"]))
    if type(opt) is torch.optim.Adagrad:
        _defaults_only(opt, g, lr_decay=0, initial_accumulator_value=0, eps=1e-10, maximize=False)
        return OptimConfig("adagrad", lr=lr, weight_decay=float(g["weight_decay"]))
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        _defaults_only(opt, g, eps=1e-8, amsgrad=False, maximize=False)
        beta1, beta2 = g["betas"]
        return OptimConfig("adam" if type(opt) is torch.optim.Adam else "adamw", lr=lr,
                           weight_decay=float(g["weight_decay"]), beta1=float(beta1), beta2=float(beta2))
    raise ValueError(f"the parameter-server shards run sgd, adam, adamw or adagrad; make_optimizer "
                     f"built {type(opt).__name__}")


def optim_settings(config: OptimConfig) -> dict[str, Any]:
    """{name: scalar} as init carries it to the shards."""
    return asdict(config)


def shard_initializer(cfg) -> Callable:
    """What worker 0 of a script run sends shards started without a model: (model,
    make_optimizer) -> (layout, {key: initial values}, optimizer settings)."""
    def initial(model: torch.nn.Module, make_optimizer: Callable) -> tuple:
        params = [p for p in model.parameters() if p.requires_grad]
        optim = optim_config_of(make_optimizer(params))
        layout = model_layout(model, dataclasses.replace(cfg, optim=optim), cfg.servers)
        return layout, split_values(layout, params), optim_settings(optim)
    return initial
