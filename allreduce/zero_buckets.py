"""What the engine zero keeps per bucket (or stage 3's unit), and the collectives it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def _collective(name: str):
    """torch's name for a collective on single tensors (torch 2.13 renamed them *_single)."""
    new = {"reduce_scatter_tensor": "reduce_scatter_single", "all_gather_into_tensor": "all_gather_single"}[name]
    return getattr(dist, new, None) or getattr(dist, name)


REDUCE_SCATTER = _collective("reduce_scatter_tensor")
ALL_GATHER = _collective("all_gather_into_tensor")


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class Bucket:
    names: list[str]
    params: list[torch.nn.Parameter]
    values: torch.Tensor
    """The parameters' flat buffer, padded to a multiple of N (their .data are views of it);
    under stage 3 its storage is there only while the bucket is gathered."""
    piece: torch.nn.Parameter
    """This rank's 1/N of values, what its optimizer steps: the same storage under stages 1
    and 2, its own under stage 3."""
    grad: torch.Tensor | None = None
    """Stage 1: the whole gradient buffer (the parameters' .grad are views of it)."""
    sending: torch.Tensor | None = None
    """Stages 2 and 3: the gradient being reduce-scattered, freed once it is."""
    ready: set[int] = field(default_factory=set)
    handle: dist.Work | None = None
    gathered: bool = True
    """Stage 3: its storage is allocated (its values in, or on their way)."""
    gathering: dist.Work | None = None
    """Stage 3: the all-gather of its values under way."""
