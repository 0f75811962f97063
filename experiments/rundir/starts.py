"""How long each start of a worker took, by phase, so that a restarted job's recovery splits
into process start, rendezvous and checkpoint load (experiments/runtime/restarts.py).

RUN_DIR/logs/start-rank<r>.jsonl gains one line per start of rank r:
    restarts       the job's restarts before this start (0: its first attempt)
    began          wall time the job object was created (imports and the data are behind)
    checkpoint_s   seconds reading and restoring this rank's checkpoint (0 without one)
    rendezvous_s   seconds meeting the other workers (or the shards) and agreeing on the model
    attached       wall time the rank was ready to train
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def start_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"start-rank{rank}.jsonl"


def record_start(run_dir: Path, rank: int, restarts: int, began: float, checkpoint_s: float,
                 rendezvous_s: float) -> None:
    """Append this start's line (one short write: lines of several starts never mix)."""
    path = start_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"restarts": restarts, "began": began,
            "checkpoint_s": checkpoint_s, "rendezvous_s": rendezvous_s, "attached": time.time()}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def read_starts(run_dir: Path) -> dict[int, list[dict]]:
    """{rank: its starts' lines}; a line cut short (a process killed mid-write) left out."""
    out: dict[int, list[dict]] = {}
    for path in sorted((Path(run_dir) / "logs").glob("start-rank*.jsonl")):
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
        out[int(path.stem[len("start-rank"):])] = lines
    return out
