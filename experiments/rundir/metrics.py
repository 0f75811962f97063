"""Run directories: per-rank step records and the summary every analysis reads."""

from __future__ import annotations

import hashlib
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch

from experiments.rundir import files
from experiments.rundir.memory import largest

WARMUP_STEPS = 1
"""Steps left out of throughput: the first step pays for allocation and connection set-up."""


class MetricsWriter:
    """Appends one JSON line per step to metrics/rank<r>.jsonl, flushed at once."""

    def __init__(self, run_dir: Path, rank: int, keep_before: int = 0) -> None:
        """keep_before: on resume, the records of earlier steps stay; later ones are redone."""
        folder = Path(run_dir) / "metrics"
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.jsonl"
        kept = ""
        if keep_before and self.path.exists():
            kept = "".join(json.dumps(r) + "\n" for r in _records(self.path) if r["step"] < keep_before)
        # The earlier records are put in place whole before any new one is appended.
        files.write_text(self.path, kept)
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def read_metrics(run_dir: Path) -> dict[int, list[dict]]:
    """Every rank's records, by rank."""
    out = {}
    for path in sorted((Path(run_dir) / "metrics").glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        out[rank] = _records(path)
    return out


def _records(path: Path) -> list[dict]:
    """A rank's records; a last line cut short (a process killed mid-write) is left out."""
    text = path.read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return [json.loads(line) for line in lines if line.strip()]


def param_sha256(model: torch.nn.Module) -> str:
    """Hash of every parameter's name, dtype, shape and bytes: equal only for identical runs."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{t.dtype}:{tuple(p.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def summarize(run_dir: Path, config: dict, eval_metrics: dict, wall_s: float, sha: str,
              first_step: int = 0, dropped: list[int] | None = None) -> dict:
    """Summary of a finished run from its metrics files.

    samples_per_sec: see `throughput`; over the steps from first_step on (a resumed run's);
    with dropped (per step, how many workers' pushes backup workers dropped), the samples
    the update used (`applied_throughput`).
    final_loss: mean training loss of the last 10% of steps (at least one) over every rank
    that ran them.
    bytes_per_worker_per_step: bytes sent plus received by one worker in one step, averaged;
    sent_bytes_per_worker_per_step and recv_bytes_per_worker_per_step: each direction apart
    (a compressed push and its pull, or an all-gather, differ).
    compress_s_per_step: seconds a worker spent per step compressing, decompressing and on
    error feedback (compress.method on allreduce and ps-*), None where not measured.
    peak_rss_mb: each rank's peak resident memory (MiB) as of its last step, freed memory its
    heap keeps for reuse included (ps/allocator.py); memory_bytes_per_worker counts tensors.
    memory_bytes_per_worker: the most bytes of parameters, gradients, optimizer state and
    communication buffers any rank held (experiments/rundir/memory.py), where counted.
    """
    per_rank = read_metrics(run_dir)
    steps = len(per_rank.get(0, []))
    tail = max(1, steps // 10)
    last = max((recs[-1]["step"] for recs in per_rank.values() if recs), default=0)
    # by step number: a rank that stopped early (killed, or a late worker gone on at the
    # shards' step) has no say in the last steps' loss
    losses = [r["loss"] for recs in per_rank.values() for r in recs if r["step"] > last - tail]
    # A resumed run's throughput is its own segment's: earlier records are another session's.
    ours = {r: [x for x in recs if x["step"] >= first_step] for r, recs in per_rank.items()}
    samples_per_sec = throughput(ours) if dropped is None else applied_throughput(ours, dropped)
    records = [r for recs in per_rank.values() for r in recs]
    traffic = [r["bytes_sent"] + r["bytes_recv"] for r in records]
    return {
        "experiment": config["experiment"],
        "engine": config["engine"],
        "workers": config["workers"],
        "servers": config.get("servers", 1),
        "steps": steps,
        "seed": config["seed"],
        "final_loss": sum(losses) / len(losses) if losses else None,
        "eval": eval_metrics,
        "samples_per_sec": samples_per_sec,
        "wall_s": wall_s,
        "bytes_per_worker_per_step": sum(traffic) / len(traffic) if traffic else 0,
        "sent_bytes_per_worker_per_step": sum(r["bytes_sent"] for r in records) / len(records) if records else 0,
        "recv_bytes_per_worker_per_step": sum(r["bytes_recv"] for r in records) / len(records) if records else 0,
        "compress_s_per_step": (sum(r["compress_s"] for r in records) / len(records)
                                if records and all("compress_s" in r for r in records) else None),
        "param_sha256": sha,
        "peak_rss_mb": {f"rank{r}": recs[-1]["peak_rss_mb"] for r, recs in sorted(per_rank.items())
                        if recs and "peak_rss_mb" in recs[-1]},
        **({"memory_bytes_per_worker": memory} if (memory := largest(records)) is not None else {}),
    }


def step_record(step: int, started: float, began: float, computed: float, done: float, loss: float,
                samples: int, stats: dict) -> dict:
    """One line of metrics/rank<r>.jsonl. Times are perf_counter readings: the loop's start,
    this step's start, the end of its backward and its end; stats is what the engine's step()
    returned (comm_s, bytes_sent, bytes_recv and its own figures; in_backward_s: the part of
    comm_s its backward spent waiting for the gradients, which is not compute)."""
    stats = dict(stats)
    in_backward = stats.pop("in_backward_s", 0.0)
    return {"step": step, "time": done - started, "wall": time.time(), "loss": loss, "samples": samples,
            "compute_s": computed - began - in_backward, "comm_s": stats.pop("comm_s", 0.0), "step_s": done - began,
            "bytes_sent": stats.pop("bytes_sent", 0), "bytes_recv": stats.pop("bytes_recv", 0),
            "peak_rss_mb": peak_rss_mb(), **stats}


def summary_config(cfg) -> dict:
    """What summary.json records of a run's config (a RunConfig)."""
    return {"experiment": cfg.experiment, "engine": cfg.engine, "workers": cfg.workers,
            "servers": cfg.servers, "seed": cfg.seed}


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def throughput(per_rank: dict[int, list[dict]], warmup: int = WARMUP_STEPS) -> float | None:
    """Samples per second of all ranks together while every rank was training.

    The window runs from the latest end of a rank's warm-up to the earliest end of a rank's
    last step (wall clock), and counts the steps that ended inside it. Under a synchronous
    engine that is the usual figure; under an asynchronous one a fast worker's extra steps
    count, and the time a finished worker would spend idle does not.
    """
    ranks = [recs for recs in per_rank.values() if recs]
    if not ranks:
        return None
    skip = warmup if all(len(recs) > warmup for recs in ranks) else 0
    # A rank's window opens when its warm-up step ends (or its first step began, if none).
    start = max(recs[skip - 1]["wall"] if skip else recs[0]["wall"] - recs[0]["step_s"]
                for recs in ranks)
    end = min(recs[-1]["wall"] for recs in ranks)
    samples = sum(r["samples"] for recs in ranks for r in recs if start < r["wall"] <= end)
    return samples / (end - start) if end > start and samples else None


def applied_throughput(per_rank: dict[int, list[dict]], dropped: list[int],
                       warmup: int = WARMUP_STEPS) -> float | None:
    """Samples per second the updates used, under backup workers: a step's records' samples
    less the share of the workers whose push was dropped (dropped[step] of them), from the end
    of the warm-up steps to the end of the last step. A step ends when the first worker has
    its update (a late worker's record of it ends later, after the others went on), and a
    late worker that went on at the shards' step has no record of the steps it skipped, so
    neither `throughput`'s window (the earliest last record) nor its count (every record's
    samples) is the run's."""
    by_step: dict[int, list[dict]] = {}
    for recs in per_rank.values():
        for r in recs:
            by_step.setdefault(r["step"], []).append(r)
    steps = sorted(by_step)
    if len(steps) <= warmup:
        return None
    start = min(r["wall"] for r in by_step[steps[warmup - 1]]) if warmup else \
        min(r["wall"] - r["step_s"] for r in by_step[steps[0]])
    end = min(r["wall"] for r in by_step[steps[-1]])
    samples = 0.0
    for s in steps[warmup:]:
        records = by_step[s]
        late = dropped[s] if s < len(dropped) else 0
        samples += sum(r["samples"] for r in records) * max(0, len(records) - late) / len(records)
    return samples / (end - start) if end > start and samples else None


def write_json(path: Path, data: dict) -> None:
    files.write_json(path, data)

