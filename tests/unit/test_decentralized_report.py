"""The decentralized comparison's report (analysis/decentralized.py) on run directories as
psar writes them: each run named by its network and engine (DiLoCo by its outer step), the
link theory of local SGD divided by its period, and the gossip runs' consensus over steps."""

from __future__ import annotations

import json

import pytest

from analysis import decentralized
from analysis.results import load_run
from test_labels import M, fake_run


def with_config(run_dir, **sections):
    config = json.loads((run_dir / "config.json").read_text())
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    (run_dir / "config.json").write_text(json.dumps(config))
    return load_run(run_dir)


def test_rows_name_the_network_and_the_engine_and_price_a_period(tmp_path):
    fake_run(tmp_path / "ring", "allreduce", workers=4, bytes_sent=M)
    fake_run(tmp_path / "diloco", "allreduce", workers=4, bytes_sent=M)
    fake_run(tmp_path / "gossip", "gossip", workers=4, bytes_sent=2 * M, topology="ring")
    ring = with_config(tmp_path / "ring", net={"racks": 2, "uplink": "50mbit"})
    diloco = with_config(tmp_path / "diloco", allreduce={"period": 8, "outer": "nesterov"}, net={"racks": 1})
    gossip = with_config(tmp_path / "gossip", net={"latency_ms": 20})
    fake_run(tmp_path / "ad", "gossip", workers=4, bytes_sent=M, topology="ring")
    ad = with_config(tmp_path / "ad", gossip={"mode": "async"})
    table = {row["engine"]: row for row in decentralized.rows([ring, diloco, gossip, ad])}
    assert table["ad-psgd/ring"]["network"] == "200mbit"
    assert table["allreduce/library"]["network"] == "200mbit, 2 racks, 50mbit uplinks"
    assert table["gossip/ring"]["network"] == "200mbit, 20 ms"
    assert table["diloco every 8"]["network"] == "200mbit"
    # the every-step ring's link time over 8; the ring of gossip sends 2M where an all-reduce sends 1.5M
    every_step = decentralized.run_link_time(diloco, decentralized.run_traffic(diloco))
    assert table["diloco every 8"]["theory_ms"] == pytest.approx(1e3 * every_step / 8)
    assert table["gossip/ring"]["theory_ms"] == pytest.approx(1e3 * every_step * 2 / 1.5)


def test_consensus_over_steps_reads_rank_zeros_measurements(tmp_path):
    fake_run(tmp_path / "gossip", "gossip", workers=2, topology="one-peer-exponential")
    path = tmp_path / "gossip" / "metrics" / "rank0.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    records[1]["consensus_distance"], records[3]["consensus_distance"] = 0.5, 0.25
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert decentralized.consensus_over_steps(load_run(tmp_path / "gossip")) == ([1, 3], [0.5, 0.25])
    assert decentralized.consensus([load_run(tmp_path / "gossip")], tmp_path / "out").exists()
