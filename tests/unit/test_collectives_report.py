"""The collectives comparison's report from a made-up sweep, and the link ideal on racks
(analysis/racks.py) for runs described by their summaries: which link binds."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.collectives import model_error, report, sweep_rows, winner_rows
from analysis.racks import flows
from analysis.results import Run

MB = 1 << 20


def row(topology, nbytes, algorithm, time_us, model_us, link_us, ran=None):
    return {"topology": topology, "bytes": nbytes, "ranks": 4, "burst_bytes": 500_000,
            "algorithm": algorithm, "ran": ran or algorithm,
            "time_us": time_us, "busbw_gbs": nbytes / time_us / 1e3, "model_us": model_us, "model_link_us": link_us}


DATA = {"rate": "1gbit", "rows": [
    row("4 ranks, flat", 4096, "ring", 3000, 1500, 100), row("4 ranks, flat", 4096, "tree", 1000, 900, 200),
    row("4 ranks, flat", 4096, "auto", 1050, 900, 200, ran="tree"),
    row("4 ranks, flat", 16 * MB, "ring", 200_000, 190_000, 188_000),
    row("4 ranks, flat", 16 * MB, "tree", 500_000, 400_000, 399_000),
    row("4 ranks, flat", 16 * MB, "auto", 210_000, 190_000, 188_000, ran="ring")]}


def test_winners_errors_and_auto_against_the_best(tmp_path):
    sweep = sweep_rows(DATA)
    winners = {w["size"]: w for w in winner_rows(sweep)}
    assert winners["4 KB"]["best"] == "tree" and winners["4 KB"]["ring_x"] == pytest.approx(3.0)
    assert winners["4 KB"]["auto"] == "tree" and winners["4 KB"]["auto_x"] == pytest.approx(1.05)
    assert winners["16 MB"]["best"] == "ring" and winners["16 MB"]["auto_x"] == pytest.approx(1.05)
    # only the 16 MB rows are link-bound: the ring is 5% above its model, the tree 25%
    text = model_error(sweep)
    assert "ring: 1 link-bound rows, median +5%" in text and "tree: 1 link-bound rows, median +25%" in text
    (tmp_path / "collectives.json").write_text(__import__("json").dumps(DATA))
    out, paths = report([], tmp_path)
    assert "where each algorithm wins" in out and all(Path(p).exists() for p in paths)


def test_auto_against_the_best_pairs_each_round_with_its_fastest():
    """auto's ratio to the best is taken round by round (each round times them a moment apart,
    under the same load), then the median: 1.1 here, where the two medians are 2.2x apart."""
    rounds = {"tree": [1000, 2000, 4000], "ring": [3000, 6000, 12000], "auto": [1100, 4400, 4400]}
    cell = [dict(row("4 ranks, flat", 4096, a, sorted(t)[1], 900, 200, ran="tree" if a == "auto" else a),
                 rounds_us=t) for a, t in rounds.items()]
    sweep = {r["algorithm"]: r for r in sweep_rows({"rate": "1gbit", "rows": cell})}
    assert sweep["auto"]["time_ms"] / sweep["tree"]["time_ms"] == pytest.approx(2.2)
    assert sweep["auto"]["vs_best"] == pytest.approx(1.1) and sweep["ring"]["vs_best"] == pytest.approx(3.0)


def fake_run(engine: str, workers: int, rack_of: dict, placement="colocated", servers=1, algorithm="ring") -> Run:
    config = {"engine": engine, "workers": workers, "servers": servers, "allreduce": {"algorithm": algorithm},
              "ps": {}, "net": {"rate": "200mbit", "placement": placement}}
    net = {"rate": "200mbit", "rate_bits": 2e8, "racks": 2, "rack_of": rack_of, "uplink_bits": 1e8,
           "placement": placement}
    return Run(Path("/nonexistent"), config, {"engine": engine, "workers": workers, "network": net}, {})


def uplink_bytes(run: Run, nbytes: float) -> float:
    racks = run.summary["network"]["rack_of"]
    return max(sum(b for (a, c), b in flows(run, nbytes).items() if racks[a] == r and racks[c] != r) for r in (0, 1))


def test_what_crosses_the_uplink_for_each_path():
    robin = {"w0": 0, "w1": 1, "w2": 0, "w3": 1}
    m = 1200.0
    # the ring in rank order crosses at every hop: 2 hosts of a rack each send 2(N-1)/N M across
    assert uplink_bytes(fake_run("allreduce", 4, robin), m) == pytest.approx(2 * 1.5 * m)
    assert uplink_bytes(fake_run("allreduce", 4, robin, algorithm="hierarchical"), m) == pytest.approx(m)
    # ps-sync, a shard per rack or both in rack 0: 2M up one of the uplinks either way
    per_rack = fake_run("ps-sync", 4, {**robin, "s0": 0, "s1": 1}, "separate", 2)
    one_rack = fake_run("ps-sync", 4, {**robin, "s0": 0, "s1": 0}, "separate", 2)
    assert uplink_bytes(per_rack, m) == pytest.approx(2 * m) == uplink_bytes(one_rack, m)
