"""How runs look in every figure: one colour per engine label, and the names in legends."""

from __future__ import annotations

import zlib

import matplotlib

from experiments.engines import label_info

from .results import Run, distinctions

matplotlib.use("Agg")  # files only, never a display

DPI = 120

FALLBACK: tuple[str, ...] = ("#e377c2", "#bcbd22", "#aec7e8", "#98df8a", "#ff9896",
                             "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
"""Colours (tab10/tab20 entries psar's engines leave unused) for labels no engine registered."""

COMPONENTS: dict[str, dict] = {  # step-time parts: neutral, so they never read as an engine
    "compute": dict(color="#c7c7c7", edgecolor="#4d4d4d"),
    "communication": dict(color="#4d4d4d", edgecolor="#4d4d4d"),
    "waiting": dict(color="white", edgecolor="#4d4d4d", hatch="///"),
}


def colour(label: str) -> str:
    """The colour of a run label, as its engine registered it (related engines get related
    hues); an unknown label gets a fallback chosen by a checksum of its text (not hash(),
    which changes with PYTHONHASHSEED), so it is the same in every process."""
    try:
        return label_info(label)[1].colour
    except ValueError:
        return FALLBACK[zlib.crc32(label.encode()) % len(FALLBACK)]


def colours(runs: list[Run]) -> dict[str, str]:
    """{run.label: colour} for the runs of one figure."""
    return {run.label: colour(run.label) for run in runs}


def label_of(run: Run, workers: bool = False) -> str:
    """run.label (with " +COMPRESSION" where it compressed), then " xN" (N workers) when `workers`, then " (S shards)" for a
    parameter-server run on more than one server: "ps-sync x4 (2 shards)"."""
    text = f"{run.label} +{run.compression}" if run.compression else run.label
    if workers:
        text += f" x{run.summary['workers']}"
    servers = run.summary.get("servers", 1)
    if run.placement:  # on an emulated network: where they were
        text += f" ({servers} shard{'s' if servers > 1 else ''}, {run.placement})"
    elif run.spec.uses_servers and servers > 1:
        text += f" ({servers} shards)"
    return text


def names(runs: list[Run], workers: bool = False) -> dict:
    """{run.path: label_of(run, workers)}, followed by "[key=value, ...]" where runs of one
    name differ in a setting (results.distinctions; without `workers`, the worker count is
    the figure's axis, not a difference): what every figure calls a run."""
    extra = distinctions(runs, lambda r: label_of(r, workers), ignore=() if workers else ("workers",))
    return {r.path: label_of(r, workers) + (f" [{extra[r.path]}]" if extra[r.path] else "") for r in runs}
