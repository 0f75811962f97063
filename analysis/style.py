"""How runs look in every figure: one colour per engine label, and the names in legends."""

from __future__ import annotations

import zlib

import matplotlib

from .results import Run

matplotlib.use("Agg")  # files only, never a display

DPI = 120

COLOURS: dict[str, str] = {  # tab10; related engines get related hues
    "local": "#7f7f7f",              # grey: the numerical reference
    "ddp": "#8c564b",                # brown
    "allreduce/library": "#1f77b4",  # blue
    "allreduce/ring": "#17becf",     # cyan
    "allreduce/library+allgather": "#9467bd",  # purple: all-reduce with gathered rows
    "allreduce/ring+allgather": "#c5b0d5",     # light purple
    "ps-sync": "#2ca02c",            # green
    "ps-async": "#d62728",           # red
    "ps-ssp": "#ff7f0e",             # orange
}
"""The colour of each known run label, the same in every figure."""

FALLBACK: tuple[str, ...] = ("#e377c2", "#bcbd22", "#aec7e8", "#98df8a", "#ff9896",
                             "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5")
"""Colours (tab10/tab20 entries unused above) for labels not in COLOURS."""

COMPONENTS: dict[str, dict] = {  # step-time parts: neutral, so they never read as an engine
    "compute": dict(color="#c7c7c7", edgecolor="#4d4d4d"),
    "communication": dict(color="#4d4d4d", edgecolor="#4d4d4d"),
    "waiting": dict(color="white", edgecolor="#4d4d4d", hatch="///"),
}


def colour(label: str) -> str:
    """The colour of a run label; an unknown label gets a fallback chosen by a checksum of its
    text (not hash(), which changes with PYTHONHASHSEED), so it is the same in every process."""
    if label in COLOURS:
        return COLOURS[label]
    return FALLBACK[zlib.crc32(label.encode()) % len(FALLBACK)]


def colours(runs: list[Run]) -> dict[str, str]:
    """{run.label: colour} for the runs of one figure."""
    return {run.label: colour(run.label) for run in runs}


def label_of(run: Run, workers: bool = False) -> str:
    """run.label, then " xN" (N workers) when `workers`, then " (S shards)" for a
    parameter-server run on more than one server: "ps-sync x4 (2 shards)"."""
    text = run.label
    if workers:
        text += f" x{run.summary['workers']}"
    servers = run.summary.get("servers", 1)
    if run.placement:  # on an emulated network: where they were
        text += f" ({servers} shard{'s' if servers > 1 else ''}, {run.placement})"
    elif run.engine.startswith("ps-") and servers > 1:
        text += f" ({servers} shards)"
    return text
