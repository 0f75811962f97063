"""TensorBoard event files of a run: each rank's scalars as it trains (`--tensorboard`), each
shard's counters, the eval metrics and the resolved config; `psar tensorboard RUN_DIR...`
writes the same from finished run directories. The files go to RUN_DIR/tensorboard/NAME/,
NAME saying experiment, engine, workers, servers and network, so that `tensorboard --logdir
runs/` shows a compare grid as comparable runs.

tensorboard is an optional extra (`pip install psar[tensorboard]`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.engines import get_engine

NEEDS = ("--tensorboard needs the tensorboard package, which is not installed: "
         "pip install 'psar[tensorboard]' (or pip install tensorboard)")


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RuntimeError(NEEDS) from None
    return SummaryWriter


def available() -> str | None:
    """None if event files can be written, else why not (one line)."""
    try:
        _summary_writer()
    except RuntimeError as err:
        return str(err)
    return None


def run_name(config: dict) -> str:
    """'quickstart ps-sync x2 s1 200mbit' from a run's config (as config.json holds it)."""
    parts = [config["experiment"], config["engine"], f"x{config['workers']}"]
    if get_engine(str(config["engine"])).uses_servers:
        parts.append(f"s{config.get('servers', 1)}")
    net = (config.get("net") or {}).get("rate")
    if net:
        parts.append(f"{net} {(config.get('net') or {}).get('placement', '')}".strip())
    return " ".join(parts)


def folder(run_dir: Path, config: dict) -> Path:
    return Path(run_dir) / "tensorboard" / run_name(config).replace(" ", "_")


class RankBoard:
    """One rank's event file, written step by step."""

    def __init__(self, run_dir: Path, config: dict, rank: int) -> None:
        self.writer = _summary_writer()(str(folder(run_dir, config) / f"rank{rank}"))

    def step(self, record: dict[str, Any]) -> None:
        write_record(self.writer, record)

    def close(self, summary: dict | None = None, config: dict | None = None) -> None:
        if summary is not None:
            write_summary(self.writer, summary, config or {})
        self.writer.close()


class ShardBoard:
    """One parameter-server shard's event file, written from its serve loop (`report`)."""

    PERIOD_S = 1.0

    def __init__(self, run_dir: Path, config: dict, shard: int) -> None:
        self.writer = _summary_writer()(str(folder(run_dir, config) / f"server{shard}"))
        self._last: tuple[float, int] | None = None

    def __call__(self, stats: dict) -> None:
        """The shard's counters, by its version (sync steps; async/ssp worker-steps)."""
        import time

        step, now = int(stats["version"]), time.monotonic()
        for key in ("updates", "pushes", "pulls", "bytes_in", "bytes_out", "rejected"):
            self.writer.add_scalar(f"shard/{key}", stats[key], step)
        if self._last is not None and now > self._last[0]:
            self.writer.add_scalar("shard/updates_per_sec", (stats["updates"] - self._last[1]) / (now - self._last[0]), step)
        self._last = (now, stats["updates"])
        waits = stats["queue_wait"]
        if waits["count"]:
            self.writer.add_scalar("shard/queue_wait_mean_s", waits["total_s"] / waits["count"], step)
        self.writer.add_scalar("shard/lost_workers", len(stats["lost_workers"]), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def write_record(writer, record: dict[str, Any]) -> None:
    """The scalars of one metrics record (one rank, one step)."""
    step = record["step"]
    writer.add_scalar("train/loss", record["loss"], step)
    if record.get("step_s"):
        writer.add_scalar("train/samples_per_sec", record["samples"] / record["step_s"], step)
    for key in ("compute_s", "comm_s", "wait_s", "step_s"):
        if record.get(key) is not None:
            writer.add_scalar(f"time/{key}", record[key], step)
    for key in ("bytes_sent", "bytes_recv"):
        writer.add_scalar(f"traffic/{key}", record.get(key, 0), step)
    stale = record.get("staleness")
    if isinstance(stale, list) and stale:
        writer.add_scalar("staleness/mean", sum(stale) / len(stale), step)
        writer.add_scalar("staleness/max", max(stale), step)


def write_summary(writer, summary: dict, config: dict) -> None:
    """Eval metrics, throughput and each shard's counters at the last step; the config as text."""
    step = max(0, int(summary.get("steps", 1)) - 1)
    for key, value in (summary.get("eval") or {}).items():
        if isinstance(value, (int, float)):
            writer.add_scalar(f"eval/{key}", value, step)
    if summary.get("samples_per_sec") is not None:
        writer.add_scalar("run/samples_per_sec", summary["samples_per_sec"], step)
    for shard in summary.get("server_stats") or []:
        i = shard.get("shard", 0)
        for key in ("updates", "pushes", "pulls", "bytes_in", "bytes_out", "malformed", "rejected"):
            if key in shard:
                writer.add_scalar(f"server{i}/{key}", shard[key], step)
        waits = shard.get("queue_wait") or {}
        if waits.get("count"):
            writer.add_scalar(f"server{i}/queue_wait_mean_s", waits["total_s"] / waits["count"], step)
        writer.add_scalar(f"server{i}/lost_workers", len(shard.get("lost_workers") or {}), step)
    if config:
        writer.add_text("config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)


def convert(run_dir: Path) -> Path:
    """Event files for a finished run directory (rank by rank from its metrics, the summary on
    rank 0's); returns the folder they are in. Earlier event files there are replaced."""
    import shutil

    from analysis.results import load_run

    run = load_run(run_dir)
    out = folder(run.path, run.config)
    shutil.rmtree(out, ignore_errors=True)
    writer_cls = _summary_writer()
    for rank, records in sorted(run.metrics.items()):
        writer = writer_cls(str(out / f"rank{rank}"))
        for record in records:
            write_record(writer, record)
        if rank == 0:
            write_summary(writer, run.summary, run.config)
        writer.close()
    return out
