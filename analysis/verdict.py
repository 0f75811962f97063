"""One line per worker count saying which engine trained fastest, by how much, whether the
spread of repeated runs lets that be told apart, and on what network: the answer a
comparison gives, where the table gives the figures."""

from __future__ import annotations

from typing import Callable

from .hostcpu import SATURATED, SHARD_BOUND, busiest_shard, host_used
from .results import Run, median
from .table import cells, rate_of


def _name(label: str, servers) -> str:
    """The cell's label, with its shards when its engine has any (table.cells gives "" else):
    "ps-sync (1 separate shard)", "ps-sync (4 shards)"."""
    if servers == "":
        return label
    count, _, where = str(servers).partition(" ")
    return f"{label} ({count}{' ' + where if where else ''} shard{'s' if count != '1' else ''})"


def verdicts(runs: list[Run]) -> list[str]:
    """_verdicts for the runs of each link rate apart (a comparison may span several)."""
    return [line for rate in sorted({rate_of(r) for r in runs})
            for line in _verdicts([r for r in runs if rate_of(r) == rate])]


def _verdicts(runs: list[Run]) -> list[str]:
    """For each worker count above 1: the fastest cell by median samples/s, every other cell
    as a ratio of it, and whether their ranges over repeats overlap (then the difference is
    within the run-to-run noise of this machine). local is left out: one process, the
    numerical reference. Cells without samples/s are left out."""
    named = cells(runs)
    rates: dict[tuple, list[float]] = {}
    for run in runs:
        rate = run.summary.get("samples_per_sec")
        if run.spec.family != "local" and rate:
            rates.setdefault(named[run.path], []).append(rate)
    nets = {(run.summary.get("network") or {}).get("rate") or "loopback" for run in runs}
    where = "/".join(sorted(nets))
    lines = []
    for workers in sorted({cell[1] for cell in rates if cell[1] > 1}):
        mine = {cell: r for cell, r in rates.items() if cell[1] == workers}
        if len(mine) < 2:
            continue
        best = max(mine, key=lambda c: median(mine[c]))
        top = median(mine[best])
        repeats = min(len(r) for r in mine.values())
        others = []
        for cell in sorted(mine, key=lambda c: -median(mine[c])):
            if cell == best:
                continue
            close = max(mine[cell]) >= min(mine[best])
            others.append(f"{_name(cell[0], cell[2])} {median(mine[cell]) / top:.2f}x"
                          + (" (ranges overlap: not told apart)" if close and repeats > 1 else ""))
        spread = (f" (range {min(mine[best]):.0f}-{max(mine[best]):.0f} over {repeats} runs)" if repeats > 1
                  else " (one run each: repeat with --repeats 3 to see the spread)")
        lines.append(f"verdict, {workers} workers on {where}: {_name(best[0], best[2])} fastest at "
                     f"{top:.0f} samples/s{spread}; " + ", ".join(others)
                     + _saturated([r for r in runs if r.spec.family != "local" and named[r.path] in mine])
                     + _shard_bound([r for r in runs if named[r.path] in mine]))
    return lines


def _saturated(runs: list[Run]) -> str:
    """A warning where some of these runs emulated their links on one machine whose cores were
    all at work through their steps (analysis/hostcpu.SATURATED): there the cores decided as
    much as the links, which a cluster's hosts would not share."""
    if not any((run.summary.get("network") or {}).get("rate") for run in runs):
        return ""  # on loopback the cores decide anyway (the next line says so)
    return _some([host_used(run) for run in runs], SATURATED, lambda n, m, top: (
        f"; in {n} of these {m} runs the host's cores were {100 * SATURATED:.0f}% in use or more through the "
        f"steps (up to {100 * top:.0f}%): there they set the pace as much as the links, and on a cluster, whose "
        "hosts each have their own, the order may differ (psar links)"))


def _shard_bound(runs: list[Run]) -> str:
    """A warning where a shard process of some of these runs held a whole core through their
    steps (analysis/hostcpu.SHARD_BOUND): there the parameter server's own message handling,
    not the links or the algorithm, set its pace."""
    return _some([busiest_shard(run) for run in runs], SHARD_BOUND, lambda n, m, top: (
        f"; in {n} of these {m} parameter-server runs a shard process held {SHARD_BOUND:.1f} of a core or more "
        f"through the steps (up to {top:.2f}): a shard handles its messages on one thread, so there the shard, "
        "not the links or the algorithm, set the pace (psar links; more shards, --servers, share that work)"))


def _some(values: list[float | None], threshold: float, say: Callable[[int, int, float], str]) -> str:
    """say(how many of the known values reach threshold, how many are known, the largest), or
    "" where none reaches it."""
    known = [v for v in values if v is not None]
    over = [v for v in known if v >= threshold]
    return say(len(over), len(known), max(over)) if over else ""
