"""psar bench's many-worker rows: a load that reaches its phases after they began says so,
rather than count what a shorter phase did (an earlier bench's start file once made every
row 0 GB/s)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from experiments.bench.suite import clear_load_files
from experiments.runtime.launcher import free_port
from ps.benchmark import load
from ps.transport import ClientTransport


@pytest.mark.timeout(90)
def test_a_load_whose_start_is_past_says_so(tmp_path):
    echo, shard = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen([sys.executable, "-m", "ps.benchmark", "serve", echo, shard, "1", "1"])
    try:
        go = tmp_path / "go"
        go.write_text(repr(time.time() - 10.0))
        with pytest.raises(RuntimeError, match="worker 0: reached the zmq phase at 65536 bytes .* after it began"):
            load(echo, shard, 0, str(go), str(tmp_path / "worker0.json"))
        assert not (tmp_path / "worker0.json").exists()
        stopper = ClientTransport(echo, None, 10.0)
        stopper.send([b"stop"])
        stopper.recv(10.0, "the echo's stop")
        stopper.close()
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()


def test_a_rows_folder_is_cleared_of_an_earlier_runs_start_and_counts(tmp_path):
    clear_load_files(tmp_path)  # a fresh folder: nothing to clear
    for name in ("go", "worker0.json", "worker0.json.ready", "worker7.json.123.tmp", "servers.log"):
        (tmp_path / name).write_text("x")
    clear_load_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["servers.log"]
