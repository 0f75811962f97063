"""An all-reduce's buckets released as backward produces them: what of the exchange a step
waits for after its backward, for `psar predict`.

The allreduce engine records, each step, when its backward made each gradient bucket ready
and the bucket's bytes (metrics' `buckets`: [seconds since backward began, bytes], in the
order they started) and how long its backward took (`backward_s`); the parameter-server
engines record each bucket they pushed the same way. Played on a cluster, each bucket's
all-reduce starts once it is ready and the bucket before it is done (buckets go in order, as
on every rank), and a parameter server's keys leave no sooner than backward released them
(schedules.parameter_server_pipelined's ready); the step waits for what ends after backward:
the exposed exchange. A run without the records, or whose steps do not agree on its buckets
(rows of tables differ from batch to batch), plays its exchange after backward, whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Callable

from .results import Run


@dataclass(frozen=True)
class Timeline:
    backward_s: float
    """The median backward, seconds."""
    buckets: tuple[tuple[float, float], ...]
    """(median seconds since backward began when it started, share of the step's bytes) of
    each bucket, in order."""


def timeline(run: Run) -> Timeline | None:
    """The run's buckets as its steady steps released them (medians over steps and ranks);
    None where a step has no record of them or the steps differ in their buckets."""
    records = run.steady_records()
    if not records or any("buckets" not in r or "backward_s" not in r for r in records):
        return None
    sizes = [tuple(size for _, size in r["buckets"]) for r in records]
    if len(set(sizes)) != 1 or not sizes[0] or sum(sizes[0]) <= 0:
        return None
    total = float(sum(sizes[0]))
    starts = [median(r["buckets"][i][0] for r in records) for i in range(len(sizes[0]))]
    return Timeline(median(r["backward_s"] for r in records),
                    tuple((at, size / total) for at, size in zip(starts, sizes[0])))


def median_timeline(lines: list[Timeline]) -> Timeline:
    """Several runs' timelines as one: the median backward and bucket times where they have the
    same buckets, else the first run's."""
    shares = [s for _, s in lines[0].buckets]
    if any([s for _, s in line.buckets] != shares for line in lines):
        return lines[0]
    return Timeline(median(line.backward_s for line in lines),
                    tuple((median(line.buckets[i][0] for line in lines), share)
                          for i, (_, share) in enumerate(lines[0].buckets)))


def exposed(line: Timeline, allreduce: Callable[[float], float]) -> float:
    """Seconds of exchange after backward: each bucket's all-reduce (allreduce(share): its
    seconds for that share of the step's bytes) from when it is ready and the one before it
    is done."""
    end = 0.0
    for ready, share in line.buckets:
        end = max(ready, end) + allreduce(share)
    return max(0.0, end - line.backward_s)


def solve_ratio(exposed_at: Callable[[float], float], measured: float) -> float:
    """The ratio r of measured to played exchange for which exposed_at(r), the exchange left
    after backward when every transfer takes r times its played time, is the measured one:
    0 where even r = 0 leaves as much (the messages' fixed costs alone), the least r that
    leaves anything where the run waited nothing after backward, and 1 (the ideal) where no
    r leaves more (nothing played: one worker)."""
    target = max(measured, 1e-12)
    if exposed_at(0.0) >= target:
        return 0.0
    low, high = 0.0, 1.0
    while exposed_at(high) < target:
        high *= 2
        if high > 1e6:  # the played exchange does not grow with r
            return 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if exposed_at(mid) < target else (low, mid)
    return (low + high) / 2
