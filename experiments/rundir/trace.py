"""Chrome trace (chrome://tracing, Perfetto) of a run: every process writes its own events,
which are merged into RUN_DIR/trace.json.

Times are wall-clock (time.time) so that processes line up; across hosts that relies on
their clocks being synchronised.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from experiments.rundir import files

TRACE_DIR = "trace"


class Tracer:
    """Collects complete ("X") events of one process; `record` is what engines are given."""

    def __init__(self, run_dir: Path, process: str, enabled: bool) -> None:
        self.path = Path(run_dir) / TRACE_DIR / f"{process.replace(' ', '')}.json"
        self.process, self.enabled = process, enabled
        self._events: list[dict] = []
        self._lock = threading.Lock()  # engines record from their communication threads too

    def record(self, name: str, start: float, end: float, thread: str = "main", **args) -> None:
        if not self.enabled:
            return
        event = {"name": name, "ph": "X", "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
                 "pid": self.process, "tid": thread}
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    @contextmanager
    def span(self, name: str, thread: str = "main", **args):
        start = time.time()
        try:
            yield
        finally:
            self.record(name, start, time.time(), thread, **args)

    def save(self) -> None:
        if not self.enabled:
            return
        files.write_json(self.path, self._events, indent=None)


def merge(run_dir: Path) -> Path | None:
    """Merge every process's events into RUN_DIR/trace.json; None if nothing was traced."""
    parts = sorted((Path(run_dir) / TRACE_DIR).glob("*.json"))
    if not parts:
        return None
    events = []
    for part in parts:
        events.extend(json.loads(part.read_text()))
    names = sorted({e["pid"] for e in events}, key=lambda p: (not p.startswith("rank"), p))
    pids = {name: i for i, name in enumerate(names)}
    meta = [{"name": "process_name", "ph": "M", "pid": i, "args": {"name": name}}
            for name, i in pids.items()]
    for e in events:
        e["pid"] = pids[e["pid"]]
    out = Path(run_dir) / "trace.json"
    return files.write_json(out, {"traceEvents": meta + events, "displayTimeUnit": "ms"}, indent=None)
