"""The graphs decentralized SGD gossips on, and their mixing weights.

A topology gives, for step t, each worker's mixing row: {j: W_ij}, the weights of the models
it averages (its own included), rows and columns each summing to 1 (W doubly stochastic, so
the workers' mean moves only by their own updates). Static graphs use Metropolis-Hastings
weights, W_ij = 1 / (1 + max(d_i, d_j)) for each neighbour j and W_ii = 1 - the rest; every
graph here is regular, so each is 1 / (d + 1).

- ring: i - 1 and i + 1 (D-PSGD's, Lian et al. 2017).
- torus: a rows x cols grid closed both ways, rows the largest divisor of N at most sqrt(N)
  (a ring where N is prime).
- exponential: i +- 2^k for every 2^k < N (SGP's static exponential graph).
- one-peer-exponential: at step t one peer each way, i + 2^k and i - 2^k, k = t mod
  ceil(log2 N): W = (I + P)/2 for the shift P, so each step sends one model whatever N is
  (Assran et al. 2019; Ying et al. 2021 show the mixing is exact after log2 N steps when N is
  a power of two).
- complete: every worker, 1/N each: the exact average, what an all-reduce of the parameters
  would give.
"""

from __future__ import annotations

import math

TOPOLOGIES = ("ring", "torus", "exponential", "one-peer-exponential", "complete")


def grid(world: int) -> tuple[int, int]:
    """The torus's rows and columns: rows the largest divisor of world at most its root."""
    rows = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    return rows, world // rows


def neighbours(topology: str, rank: int, world: int) -> list[int]:
    """The static graph's neighbours of rank, sorted (one-peer-exponential: every peer it
    ever exchanges with)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"gossip.topology={topology!r}: expected one of {', '.join(TOPOLOGIES)}")
    if topology == "ring":
        found = {(rank - 1) % world, (rank + 1) % world}
    elif topology == "torus":
        rows, cols = grid(world)
        r, c = divmod(rank, cols)
        found = {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c,
                 r * cols + (c - 1) % cols, r * cols + (c + 1) % cols}
    elif topology in ("exponential", "one-peer-exponential"):
        found = {(rank + s * 2 ** k) % world for k in range(hops(world)) for s in (1, -1)}
    else:
        found = set(range(world))
    return sorted(found - {rank})


def hops(world: int) -> int:
    """The offsets 2^k < world: ceil(log2 world), one-peer-exponential's period."""
    return max(1, math.ceil(math.log2(world))) if world > 1 else 0


def period(topology: str, world: int) -> int:
    """Steps after which the graph's schedule repeats: one-peer-exponential's ceil(log2 N),
    1 for the static graphs."""
    return max(1, hops(world)) if topology == "one-peer-exponential" else 1


def peers(topology: str, rank: int, world: int, step: int) -> tuple[list[int], list[int]]:
    """(the workers rank sends its model to at step, those it receives one from)."""
    if topology == "one-peer-exponential":
        if world == 1:
            return [], []
        offset = 2 ** (step % hops(world))
        return [(rank + offset) % world], [(rank - offset) % world]
    found = neighbours(topology, rank, world)
    return found, found


def mixing_row(topology: str, rank: int, world: int, step: int) -> dict[int, float]:
    """Row rank of W at step: {worker: weight}, its own weight included; the weights sum to 1."""
    if topology == "one-peer-exponential":
        _, sources = peers(topology, rank, world, step)
        row = {rank: 1.0 / (1 + len(sources))}
        row.update({j: 1.0 / (1 + len(sources)) for j in sources})
        return row
    found = neighbours(topology, rank, world)
    if topology == "complete":
        return {j: 1.0 / world for j in range(world)}
    weight = 1.0 / (1 + len(found))  # Metropolis-Hastings on a regular graph
    return {rank: 1.0 - weight * len(found), **{j: weight for j in found}}


def matrix(topology: str, world: int, step: int) -> list[list[float]]:
    """W at step, whole (tests, the one-process reference and the spectral gap)."""
    rows = []
    for i in range(world):
        row = mixing_row(topology, i, world, step)
        rows.append([row.get(j, 0.0) for j in range(world)])
    return rows
