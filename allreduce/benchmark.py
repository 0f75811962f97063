"""All-reduce bandwidth in the style of nccl-tests: run on every rank, `python -m allreduce.benchmark OUT`
(--latency: the latency row; --spec FILE: sweep()'s sizes and algorithms on the job's links).

For each size, the backend's all-reduce and our ring run alternately on the same buffers,
so both see the same machine load. algbw = bytes / time; busbw = algbw * 2(N-1)/N, the
bandwidth each link carries, comparable across world sizes.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .auto import choose
from .collective import ours

SIZES = [2**k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
ALGORITHMS = ("library", "ring", "halving-doubling")
LATENCY = dict(nbytes=64 * 1024, delay_s=0.005, iters=3)
"""The latency row (--latency): 64 KiB with 5 ms injected per message, ring against
halving-doubling and tree: 2(N-1) steps against 2 log2 N."""


def measure_latency(rank: int, world: int, rounds: int = 3) -> list[dict]:
    """Our algorithms at LATENCY's size with its per-message delay (median of rounds)."""
    buf = torch.ones(LATENCY["nbytes"] // 4)
    rows = []
    for algorithm in ("ring", "halving-doubling", "tree"):
        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(LATENCY["iters"]):
                run_algorithm(algorithm, buf, rank, world, LATENCY["delay_s"])
            elapsed = torch.tensor([(time.perf_counter() - start) / LATENCY["iters"]], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        rows.append({"bytes": LATENCY["nbytes"], "algorithm": algorithm, "delay_ms": 1e3 * LATENCY["delay_s"],
                     "time_us": sorted(times)[len(times) // 2] * 1e6})
    return rows


ROUNDS = 7
BUDGET_S = 0.05
"""measure(): the algorithms take turns in ROUNDS rounds, each timing as many all-reduces as
fill BUDGET_S. One all-reduce per timing (as this table had at 4 MiB and above) left the ring
anywhere from 0.56x to 1.05x of the library at 4 MiB from one run to the next on 2 cores."""


def measure(rank: int, world: int, sizes=SIZES, device: str = "cpu", rounds: int = ROUNDS) -> list[dict]:
    """Median time per all-reduce of each size and algorithm; rows as nccl-tests prints them,
    and vs_library: the library's time over the algorithm's, the median of the rounds' (each
    round times both a moment apart)."""
    rows = sweep(rank, world, {"sizes": list(sizes), "algorithms": list(ALGORITHMS), "rounds": rounds,
                               "budget_s": BUDGET_S}, device)
    for row in rows:
        row["algbw_gbs"] = row["bytes"] / row["time_us"] / 1e3
    return rows


def run_algorithm(algorithm: str, buf: torch.Tensor, rank: int, world: int, delay_s: float = 0.0,
                  racks: tuple[int, ...] | None = None, bandwidth: float | None = None,
                  uplink: float | None = None, crowded: float = 1.0) -> str:
    """One all-reduce of buf by allreduce.algorithm's `algorithm`; the one that ran (auto's pick)."""
    if algorithm == "auto":
        algorithm = choose(buf.numel() * buf.element_size(), world, delay_s, bandwidth, racks, uplink, crowded)
    if algorithm == "library":
        if delay_s:
            time.sleep(2 * (world - 1) * delay_s)  # as LibraryAllReduce delays it
        dist.all_reduce(buf)
    else:
        ours(algorithm, racks, bandwidth is not None, crowded)[0](buf, rank, world, delay_s=delay_s)
    return algorithm


SMALL_BYTES = 1 << 20
"""sweep() runs sizes up to this twice as many rounds."""


def round_order(algorithms: list[str], k: int) -> list[str]:
    """The order the algorithms take turns in round k: every other round backwards, and each
    pair of rounds starting one later, so that none always comes first or right after the
    same one (on shaped links an algorithm finds the links as the one before left them: their
    burst spent, their queues' state)."""
    n = max(1, len(algorithms))
    order = list(algorithms[(k // 2) % n:]) + list(algorithms[:(k // 2) % n])
    return order[::-1] if k % 2 else order


BLOCK_S = 0.02
"""sweep()'s algorithms take turns in blocks of calls this long (spec["block_s"]; 0: call by
call, each after a barrier). Inside a block calls go back to back, as nccl-tests time them:
psar bench's loopback table, where a call after a barrier alone pays its receives' first
notices (our ring's 1 KiB took 2.1x the library's time so, 0.5x to 1.6x back to back).
Blocks are short enough that a busy machine's slow spells, seconds long, fall on every
algorithm alike (timed one algorithm after the other, the tree's 4 KB took 1.1 ms in one
round and 3.4 in another, and auto running the tree 1.13x the tree). On shaped links a
block finds the links as the block before left them, their burst spent or not, so psar
compare collectives goes call by call: at 64 KB on 4 ranks auto running the tree took
1.30x the tree in blocks, 0.95 to 1.02x call by call."""


def _interleaved(order: list[str], iters: dict[str, int], block: dict[str, int], buf: torch.Tensor,
                 rank: int, world: int, args: dict, device: str) -> dict[str, float]:
    """One round: each algorithm's iters[a] all-reduces, in blocks of block[a] calls back to
    back after a barrier, the algorithms' blocks taking turns in `order`; each one's mean
    seconds, its slowest rank's."""
    spent, done = {a: 0.0 for a in order}, {a: 0 for a in order}
    while any(done[a] < iters[a] for a in order):
        for algorithm in order:
            calls = min(block[algorithm], iters[algorithm] - done[algorithm])
            if calls <= 0:
                continue
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                run_algorithm(algorithm, buf, rank, world, **args)
            if device != "cpu":
                torch.cuda.synchronize()
            spent[algorithm] += time.perf_counter() - start
            done[algorithm] += calls
    mean = torch.tensor([spent[a] / iters[a] for a in order], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    return dict(zip(order, mean.tolist()))


def sweep(rank: int, world: int, spec: dict, device: str = "cpu") -> list[dict]:
    """Every size of spec["sizes"] by every algorithm of spec["algorithms"] on this job's
    links: racks, delay_s (per message), bandwidth and uplink (bytes/s, auto's model) as the
    spec gives them. The algorithms take turns in spec["rounds"] rounds (twice as many up to
    SMALL_BYTES; the median), in round_order, in blocks of spec["block_s"] (BLOCK_S), each
    timing enough repetitions to fill spec["budget_s"] seconds, after one warm-up each. Each row
    keeps its rounds' times (rounds_us); with the library among them, its vs_library is the
    library's time over its own, the median of the rounds'."""
    racks = tuple(spec["racks"]) if spec.get("racks") else None
    args = dict(delay_s=spec.get("delay_s", 0.0), racks=racks, bandwidth=spec.get("bandwidth"),
                uplink=spec.get("uplink"), crowded=spec.get("crowded", 1.0))
    rows = []
    for nbytes in spec["sizes"]:
        buf = torch.ones(max(1, nbytes // 4), device=device)
        first: dict[str, float] = {}
        chosen: dict[str, str] = {}
        for algorithm in spec["algorithms"]:  # warm-up, and how long one takes
            dist.barrier()
            start = time.perf_counter()
            chosen[algorithm] = run_algorithm(algorithm, buf, rank, world, **args)
            if device != "cpu":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            first[algorithm] = elapsed.item()
        times: dict[str, list[float]] = {a: [] for a in spec["algorithms"]}
        iters = {a: max(1, min(100, int(spec.get("budget_s", 0.3) / max(first[a], 1e-6)))) for a in first}
        block_s = spec.get("block_s", BLOCK_S)
        block = {a: max(1, int(block_s / max(first[a], 1e-6))) if block_s else 1 for a in first}
        # A few ms apart, a small size's algorithms differ by less than a busy machine's
        # noise in 3 rounds (auto and the algorithm it ran came 11 to 18% apart): twice as many.
        for k in range(spec.get("rounds", 3) * (2 if nbytes <= SMALL_BYTES else 1)):
            took = _interleaved(round_order(spec["algorithms"], k), iters, block, buf, rank, world, args, device)
            for algorithm, seconds in took.items():
                times[algorithm].append(seconds)
        for algorithm in spec["algorithms"]:
            t = statistics.median(times[algorithm])
            row = {"bytes": nbytes, "algorithm": algorithm, "ran": chosen[algorithm], "time_us": t * 1e6,
                   "busbw_gbs": nbytes / t / 1e9 * 2 * (world - 1) / world,
                   "rounds_us": [x * 1e6 for x in times[algorithm]]}
            if "library" in times:
                row["vs_library"] = statistics.median(a / b for a, b in zip(times["library"], times[algorithm]))
            rows.append(row)
    return rows


def main(out_path: str) -> None:
    device = "cuda" if torch.cuda.is_available() and "--cuda" in sys.argv else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if "--spec" in sys.argv:
        with open(sys.argv[sys.argv.index("--spec") + 1]) as f:
            rows = sweep(rank, world, json.load(f))
    elif "--latency" in sys.argv:
        rows = measure_latency(rank, world)
    else:
        rows = measure(rank, world, device=device)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "backend": backend, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
