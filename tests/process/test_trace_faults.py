"""--trace writes a Chrome trace of every process; fault.delay_ms slows every message."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def POOL_JOBS() -> dict[str, dict]:
    return {
        "ring": dict(experiment="cnn", engine="allreduce", steps=6,
                     overrides=("trace=true", "allreduce.algorithm=ring", "allreduce.bucket_cap_mb=0.02",
                               "allreduce.first_bucket_mb=0.02")),
        "ps": dict(experiment="quickstart", engine="ps-sync", servers=2, steps=6, overrides=("trace=true",)),
        "ring-fast": dict(experiment="quickstart", engine="allreduce", steps=12,
                          overrides=("allreduce.algorithm=ring",)),
        "ring-slow": dict(experiment="quickstart", engine="allreduce", steps=12,
                          overrides=("allreduce.algorithm=ring", "fault.delay_ms=20")),
        "ps-fast": dict(experiment="quickstart", engine="ps-async", steps=12),
        "ps-slow": dict(experiment="quickstart", engine="ps-async", steps=12, overrides=("fault.delay_ms=20",)),
    }


@pytest.fixture(scope="module")
def runs(pool):
    return pool.folder(__name__)


def _events(run_dir):
    trace = json.loads((run_dir / "trace.json").read_text())
    names = {m["pid"]: m["args"]["name"] for m in trace["traceEvents"] if m["ph"] == "M"}
    return [dict(e, process=names[e["pid"]]) for e in trace["traceEvents"] if e["ph"] == "X"]


def test_allreduce_trace_shows_buckets_overlapping_backward(runs):
    events = _events(runs / "ring")
    for rank in ("rank 0", "rank 1"):
        mine = [e for e in events if e["process"] == rank]
        assert {"forward", "backward", "step"} <= {e["name"] for e in mine}
        buckets = [e for e in mine if e["name"].startswith("all-reduce bucket")]
        assert len(buckets) >= 2 * 6  # several buckets per step
        backward = [e for e in mine if e["name"] == "backward"]
        # Some bucket starts before its step's backward has finished: communication overlaps.
        assert any(b["ts"] < bw["ts"] + bw["dur"] and b["ts"] > bw["ts"] for b in buckets for bw in backward)


def test_ps_trace_has_pushes_pulls_and_server_updates(runs):
    events = _events(runs / "ps")
    processes = {e["process"] for e in events}
    assert processes == {"rank 0", "rank 1", "server 0", "server 1"}
    # quickstart's 4 parameters fit in one bucket (ps.bucket_kb): under sync one message per
    # worker and step pushes the bucket and asks for its next values (push+pull).
    pushes = [e for e in events if e["name"].startswith("push+pull ")]
    assert len(pushes) == 2 * 6 and all("(4 parameters)" in e["name"] for e in pushes)
    assert all(e["args"]["waited_on_server_s"] >= 0 for e in pushes)
    assert not [e for e in events if e["name"].startswith(("push ", "pull "))]
    # sync: each of the shard's keys is updated once per step, as soon as both workers pushed it
    updates = [e for e in events if e["process"] == "server 0" and e["name"].startswith("update key")]
    assert updates and len(updates) % 6 == 0 and {e["args"]["version"] for e in updates} == set(range(6))


def _fastest_step(run_dir):
    # The fastest step, not the median: a delay that every message pays sets a floor under
    # each step, while a busy machine only lengthens some steps (a CI run's median fast
    # step was 19 ms against 2.5 ms here, its slow one 53 ms).
    records = [json.loads(line) for line in (run_dir / "metrics/rank0.jsonl").read_text().splitlines()]
    return min(r["comm_s"] + r["compute_s"] for r in records[1:])


def test_delay_slows_every_message(runs):
    # quickstart's all-reduce is one bucket: 2(N-1) = 2 ring messages of 20 ms each.
    assert _fastest_step(runs / "ring-slow") - _fastest_step(runs / "ring-fast") > 0.035
    # A parameter-server round trip pays the delay on the request and on the reply.
    assert _fastest_step(runs / "ps-slow") - _fastest_step(runs / "ps-fast") > 0.035
