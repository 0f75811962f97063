"""Settings of the decentralized engine gossip (`--set gossip.KEY=VALUE`)."""

from __future__ import annotations

from dataclasses import dataclass

from .topology import TOPOLOGIES

MODES = ("sync", "async")


@dataclass(frozen=True)
class GossipConfig:
    topology: str = "ring"
    """The graph the workers average on (allreduce/topology.py): ring, torus, exponential,
    one-peer-exponential or complete."""
    mode: str = "sync"
    """'sync': D-PSGD (Lian et al. 2017), every worker mixes with its neighbours each step;
    'async': AD-PSGD (Lian et al. 2018), each active (even) worker averages with one passive
    (odd) neighbour in turn, atomically, and nobody waits for anyone else (allreduce/gossip_async.py)."""
    consensus_every: int = 10
    """Steps between measurements of the consensus distance (the mean over workers of
    ||x_i - mean x||^2: an all-reduce of the model, not counted in the step's bytes); the last
    step's is always measured, at close, which is the only one under mode=async (a measurement
    is a barrier)."""

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"gossip.topology={self.topology!r}: expected one of {', '.join(TOPOLOGIES)}")
        if self.mode not in MODES:
            raise ValueError(f"gossip.mode={self.mode!r}: expected one of {', '.join(MODES)}")
        if type(self.consensus_every) is not int or self.consensus_every < 1:
            raise ValueError(f"gossip.consensus_every={self.consensus_every!r}: must be an int >= 1")
