"""psar compare collectives' sweep end to end on a small emulated network: ranks on hosts in
two racks behind an uplink, every algorithm timed, the model beside each, and the report's
files. Needs root and iproute2; skipped elsewhere, with the reason."""

from __future__ import annotations

import json
import os

import pytest

from experiments.runtime import netns

REASON = netns.unavailable()


@pytest.mark.skipif(REASON is not None, reason=f"emulated hosts unavailable: {REASON}")
@pytest.mark.long  # 10 s: make bench
@pytest.mark.timeout(180)
def test_a_small_sweep_times_every_algorithm_beside_the_model(tmp_path, monkeypatch):
    import experiments.comparisons.collectives as collectives
    from analysis.collectives import report

    monkeypatch.setattr(collectives, "topologies", lambda cores=None: (
        collectives.Topology(4, racks=2, sizes=(4096, 1 << 20)),))
    path = collectives.measure(tmp_path, echo=lambda _: None, rounds=1)
    rows = json.loads(path.read_text())["rows"]
    algorithms = {r["algorithm"] for r in rows}
    assert algorithms == set(collectives.ALGORITHMS)
    assert all(r["time_us"] > 0 and r["model_us"] > r["model_link_us"] >= 0 for r in rows)
    # 1 MB on two racks behind 4:1 uplinks: the ring in rank order crosses at every hop
    at = {r["algorithm"]: r for r in rows if r["bytes"] == 1 << 20}
    assert at["hierarchical"]["model_us"] < 0.7 * at["ring"]["model_us"]
    assert at["auto"]["ran"] in collectives.ALGORITHMS
    text, paths = report([], tmp_path)
    assert "where each algorithm wins" in text and all(p.exists() for p in paths)
    assert not [n for n in netns._namespaces() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")]
