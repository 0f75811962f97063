"""BytePS's spare-server result on a shaped network, as ratios to the link rate or to a ring
run measured in the same file: `psar run mlp-mid --net 200mbit --steps 6`, rank 0's median
step after the first.

- one separate shard, 2 workers: within 1.15 of N·M/B (its link carries N·M each way, at once);
- 4 workers with 4 separate shards: at most 0.8 of the 4-worker ring (M/B against 2(N-1)/N·M/B);
- 4 co-located shards: within 1.15 of that ring (the same bytes on the same links);
- mlp-wide on one separate shard: 4 workers' step about twice 2 workers'.

Marked `long` (about 4 minutes): `make bench` runs it, `make test` does not. Needs root and
iproute2; skipped elsewhere, with the reason.
"""

from __future__ import annotations

import json
import statistics

import pytest

from analysis.traffic import gradient_bytes
from analysis.linkmodel import PAYLOAD
from analysis.results import load_run
from experiments.runtime import netns as network
from experiments.runtime.launcher import launch
from experiments.settings.presets import build_config

REASON = network.unavailable()
pytestmark = [pytest.mark.long, pytest.mark.multiprocess, pytest.mark.timeout(1500),
              pytest.mark.skipif(REASON is not None, reason=f"emulated hosts unavailable: {REASON}")]

RATE = "200mbit"


def run(tmp_path, experiment: str, engine: str, workers: int, servers: int = 1, placement: str = "colocated"):
    """(rank 0's median step_s after the first, M/B in seconds) of a 6-step run."""
    cfg = build_config(experiment, (f"net.rate={RATE}", f"net.placement={placement}"), engine=engine,
                       workers=workers, servers=servers, steps=6)
    run_dir = tmp_path / f"{experiment}-{engine}-w{workers}-s{servers}-{placement}"
    launch(cfg, run_dir, deadline_s=900, quiet=True)
    records = [json.loads(line) for line in (run_dir / "metrics/rank0.jsonl").read_text().splitlines()]
    m_over_b = gradient_bytes(load_run(run_dir)) * 8 / (network.parse_rate(RATE) * PAYLOAD)
    return statistics.median(r["step_s"] for r in records[1:]), m_over_b


def test_spare_shards_beat_the_ring_and_co_located_ones_track_it(tmp_path, capsys):
    one, m_b = run(tmp_path, "mlp-mid", "ps-sync", 2, 1, "separate")
    ring, _ = run(tmp_path, "mlp-mid", "allreduce", 4)
    spare, _ = run(tmp_path, "mlp-mid", "ps-sync", 4, 4, "separate")
    colocated, _ = run(tmp_path, "mlp-mid", "ps-sync", 4, 4, "colocated")
    with capsys.disabled():
        print(f"\nmlp-mid at {RATE} (M/B {m_b:.3f} s): one separate shard x2 {one:.2f} s ({one / (2 * m_b):.2f} "
              f"of N·M/B); ring x4 {ring:.2f} s; 4 separate shards x4 {spare:.2f} s ({spare / ring:.2f} of the "
              f"ring); 4 co-located x4 {colocated:.2f} s ({colocated / ring:.2f} of the ring)")
    assert one <= 1.15 * 2 * m_b
    assert spare <= 0.8 * ring
    assert colocated <= 1.15 * ring


def test_one_shards_step_grows_with_the_workers(tmp_path, capsys):
    two, _ = run(tmp_path, "mlp-wide", "ps-sync", 2, 1, "separate")
    four, _ = run(tmp_path, "mlp-wide", "ps-sync", 4, 1, "separate")
    with capsys.disabled():
        print(f"\nmlp-wide at {RATE}, one separate shard: 2 workers {two:.2f} s, 4 workers {four:.2f} s "
              f"({four / two:.2f}x)")
    assert 1.6 <= four / two <= 2.4
