"""Files shared by the processes of a run: never seen half-written, waited for when late."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from experiments.rundir import files
from experiments.rundir.metrics import MetricsWriter, read_metrics

ROOT = Path(__file__).resolve().parents[2]

WRITER = """
import sys
from experiments.rundir import files
path, tag = sys.argv[1], sys.argv[2]
for i in range(300):
    files.write_json(path, {"writer": tag, "i": i, "pad": "x" * 20000})
"""


@pytest.mark.timeout(60)
def test_a_reader_never_sees_a_half_written_file(tmp_path):
    """Two processes rewrite one file as fast as they can (as every worker sharing --out
    writes config.json); a reader polling it always parses a whole one."""
    path = tmp_path / "config.json"
    files.write_json(path, {"writer": "first"})
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag], cwd=ROOT)
               for tag in ("a", "b")]
    reads, seen = 0, set()
    try:
        while any(w.poll() is None for w in writers):
            seen.add(json.loads(path.read_text())["writer"])  # raises on a torn file
            reads += 1
    finally:
        for w in writers:
            w.wait(timeout=30)
    assert [w.returncode for w in writers] == [0, 0]
    assert reads > 10 and seen & {"a", "b"}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"], "temporary files left behind"


def test_wait_for_waits_for_a_late_file_and_names_a_missing_one(tmp_path):
    path = tmp_path / "servers.json"
    threading.Timer(0.3, files.write_json, (path, ["tcp://a:1"])).start()
    started = time.monotonic()
    assert files.read_json(path, timeout_s=10) == ["tcp://a:1"]
    assert 0.2 < time.monotonic() - started < 5
    with pytest.raises(FileNotFoundError, match=r"server list .*nothing\.json does not exist \(waited 0.2 s\)"):
        files.read_json(tmp_path / "nothing.json", timeout_s=0.2, what="server list")
    (tmp_path / "torn.json").write_text('{"a": ')
    with pytest.raises(ValueError, match="torn.json is unreadable"):
        files.read_json(tmp_path / "torn.json", timeout_s=0)


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    files.write_json(path, {"v": 1})

    def broken(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_with(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_metrics_of_a_killed_rank_lose_only_the_torn_line(tmp_path):
    writer = MetricsWriter(tmp_path, 1)
    for step in range(3):
        writer.write({"step": step, "loss": 1.0})
    writer.close()
    with open(tmp_path / "metrics/rank1.jsonl", "a") as f:
        f.write('{"step": 3, "lo')  # SIGKILL in the middle of a write
    assert [r["step"] for r in read_metrics(tmp_path)[1]] == [0, 1, 2]
    # A resumed rank keeps the whole records before its checkpoint, and only those.
    resumed = MetricsWriter(tmp_path, 1, keep_before=2)
    resumed.write({"step": 2, "loss": 0.5})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)[1]] == [(0, 1.0), (1, 1.0), (2, 0.5)]
