"""Checkpoints of a worker: model (with buffers), optimizer state when the worker runs the
optimizer, and the next step, which is also the data position (a batch is a pure function of
its step). Written atomically: a temporary file, then a rename.

Parameter-server shards write their own (ps.shard.ShardServer.state_dict), at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.rundir import files

if TYPE_CHECKING:
    import torch

CHECKPOINT_DIR = "checkpoint"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints (0: none). Parameter-server shards save at the same steps."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every}: must be >= 0")


def save_atomic(state: dict, path: Path) -> None:
    """torch.save to a temporary file beside `path`, then rename: never a half-written file."""
    files.save_torch(state, path)


def load(path: Path) -> dict:
    """A checkpoint written by save_atomic (tensors, numbers and dicts only: weights_only)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: was the run started with "
                                "--set checkpoint.every=K, and did it reach step K?")
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def worker_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"rank{rank}.pt"


def server_path(run_dir: Path, shard: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"server{shard}.pt"


class WorkerCheckpoints:
    """What the training loop calls: restore once at the start, save every `every` steps."""

    def __init__(self, run_dir: Path, rank: int, every: int, resume: bool) -> None:
        self.path, self.every = worker_path(run_dir, rank), every
        self.state = load(self.path) if resume else None
        self.optimizers: list[torch.optim.Optimizer] = []

    @property
    def start_step(self) -> int:
        return int(self.state["step"]) if self.state else 0

    def restore_model(self, model: torch.nn.Module) -> bool:
        """Load this rank's model from the checkpoint; whether there was one."""
        if self.state:
            model.load_state_dict(self.state["model"])
        return bool(self.state)

    def optimizer_factory(self, build):
        """Wrap the experiment's optimizer factory: keep the optimizer (restore_optimizer
        gives it its state, once the engine has attached)."""
        def make(params):
            optimizer = build(params)
            self.optimizers.append(optimizer)
            return optimizer
        return make

    def restore_optimizer(self) -> None:
        """The checkpoint's optimizer state into the optimizer the engine built (after attach:
        the engine zero cuts the file's state, in torch's layout, into each rank's pieces)."""
        if self.state and self.state.get("optimizer") is not None and self.optimizers:
            self.optimizers[0].load_state_dict(self.state["optimizer"])

    def after_step(self, steps_done: int, model: torch.nn.Module) -> None:
        if not self.every or steps_done % self.every:
            return
        consolidate = getattr(self.optimizers[0], "consolidate_state_dict", None) if self.optimizers else None
        if consolidate is not None:  # zero: every rank's file holds the whole state (and stage 3's values)
            consolidate(to=None)
        optimizer = self.optimizers[0].state_dict() if self.optimizers else None
        model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        save_atomic({"step": steps_done, "model": model_state, "optimizer": optimizer}, self.path)
