"""allreduce.algorithm=auto: for each bucket, the algorithm the alpha-beta model predicts
fastest for its size on the run's links, as NCCL picks ring or tree per message size.

A step of an algorithm costs alpha (a message's fixed cost: MESSAGE_S on loopback Gloo, plus
the run's per-message delay, net.latency_ms or fault.delay_ms) plus its bytes over the link's
bandwidth (net.rate, or LOOPBACK_BYTES_S without an emulated network). For S bytes on N ranks:

    ring               2(N-1) (alpha + S/N / B)
    halving-doubling   2 log2(p) alpha + 2(p-1)/p S / B, + 2 (alpha + S / B) where N is not
                       a power of two p (the folded ranks' whole tensors, there and back)
    tree               2 ceil(log2 N) (alpha + S / B)

Every rank computes the same choice from the same numbers: no message is needed to agree.
The model leaves out the pieces' pipelining, which each algorithm has alike.
"""

from __future__ import annotations

import math

MESSAGE_S = 2e-4
"""A message's fixed cost on loopback Gloo: a 1 KiB exchange between 2 ranks took 186 us."""
LOOPBACK_BYTES_S = 1.2e9
"""A link's bandwidth without an emulated network: psar bench's busbw on 2 ranks, 1.15 to 1.3
GB/s from 4 MiB on this 2-core machine."""
ALGORITHMS = ("ring", "halving-doubling", "tree")


def predict(algorithm: str, nbytes: float, world: int, alpha: float, bandwidth: float) -> float:
    """The model's seconds for one all-reduce of nbytes on `world` ranks."""
    if world == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (world - 1) * (alpha + nbytes / world / bandwidth)
    if algorithm == "halving-doubling":
        p = 1 << (world.bit_length() - 1)
        t = 2 * math.log2(p) * alpha + 2 * (p - 1) / p * nbytes / bandwidth
        return t + (2 * (alpha + nbytes / bandwidth) if p != world else 0.0)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(world)) * (alpha + nbytes / bandwidth)
    raise ValueError(f"no model of algorithm {algorithm!r}")


def choose(nbytes: float, world: int, delay_s: float = 0.0, bandwidth: float | None = None) -> str:
    """The fastest of ALGORITHMS by the model (the ring where they tie)."""
    alpha, b = MESSAGE_S + delay_s, bandwidth or LOOPBACK_BYTES_S
    return min(ALGORITHMS, key=lambda a: (predict(a, nbytes, world, alpha, b), a != "ring"))
