"""Where a worker computes: its device, and its share of the host's cores."""

from __future__ import annotations

import torch

from ps.cores import core_share

from experiments.settings.config import RunConfig
from experiments.harness.distenv import DistEnv


def pick_device(cfg: RunConfig, env: DistEnv) -> torch.device:
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def set_threads(cfg: RunConfig, env: DistEnv) -> None:
    # Workers on one host share its cores; oversubscribing them slows every engine alike.
    torch.set_num_threads(core_share(max(1, env.local_world), cfg.threads))
