"""`psar predict` (analysis/predict.py, experiments/cli/predicting.py) on run directories as
psar writes them: a run predicted on its own cluster is its measured step (the calibration
carries psar's implementation along), other clusters scale its exchange as the schedules
play it, an engine without a run gets the ideal, and the JSON rows are the contract's."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from analysis.predict import Target, exchange, fixed_cost, predict, validate
from analysis.results import load_run
from experiments.cli.predicting import predict_cmd
from test_labels import M, RATE_BITS, fake_run


def test_a_run_predicted_on_its_own_cluster_is_its_measured_step_and_others_scale(tmp_path):
    """The exchange scales by the run's measured-to-played ratio, the messages' fixed cost
    apart; ps-sync, with no run, gets the ideal."""
    run = fake_run(tmp_path / "ar", "allreduce", workers=2, compute_s=0.1, step_s=0.5)
    own = Target(2, RATE_BITS / 8)
    bigger = Target(8, RATE_BITS / 8 / 2)
    rows = predict([run], ["allreduce/library", "ps-sync"], [own, bigger])
    at = {(r["engine"], r["workers"]): r for r in rows}
    assert at["allreduce/library", 2]["step_s"] == pytest.approx(0.5)
    ratio = (0.4 - fixed_cost("allreduce/library", own)) / exchange("allreduce/library", own, M)
    assert at["allreduce/library", 8]["comm_s"] == pytest.approx(exchange("allreduce/library", bigger, M) * ratio
                                                                 + fixed_cost("allreduce/library", bigger))
    assert fixed_cost("allreduce/library", bigger) == pytest.approx(14 * 2 * 2.5e-4)  # 2(N-1) hops
    assert fixed_cost("allreduce/library", Target(8, RATE_BITS / 8, message=1e-5)) == pytest.approx(14 * 2e-5)
    out = CliRunner().invoke(predict_cmd, [str(tmp_path / "ar"), "--workers", "8", "--net", "100mbit",
                                           "--message-us", "0", "--json"])
    [row] = json.loads(out.output)
    assert row["comm_s"] == pytest.approx(exchange("allreduce/library", Target(8, 100e6 / 8), M) * ratio)
    assert at["ps-sync", 8]["calibrated"] is False  # no ps-sync run: the ideal, with the ring's compute
    assert at["ps-sync", 8]["comm_s"] == pytest.approx(exchange("ps-sync", bigger, M))


def test_the_json_rows_are_one_per_engine_and_worker_count(tmp_path):
    fake_run(tmp_path / "ar", "allreduce", workers=2)
    fake_run(tmp_path / "ps", "ps-sync", workers=2)
    out = CliRunner().invoke(predict_cmd, [str(tmp_path / "ar"), str(tmp_path / "ps"), "--workers", "4,1024",
                                           "--net", "100mbit", "--servers", "4", "--set", "net.placement=separate",
                                           "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [(r["engine"], r["workers"], r["servers"]) for r in rows] == [
        ("allreduce/library", 4, None), ("allreduce/library", 1024, None), ("ps-sync", 4, 4), ("ps-sync", 1024, 4)]
    assert all(r["step_s"] > 0 for r in rows)
    for r in rows:  # against one worker, whose step is its compute; the busiest links by the algorithm
        assert r["efficiency"] == pytest.approx(r["compute_s"] / r["step_s"])
    at = {(r["engine"], r["workers"]): r for r in rows}
    assert at["allreduce/library", 4]["worker_link_bytes"] == pytest.approx(2 * 3 / 4 * M)
    assert at["allreduce/library", 4]["shard_link_bytes"] is None
    assert at["ps-sync", 1024]["worker_link_bytes"] == pytest.approx(M)
    assert at["ps-sync", 1024]["shard_link_bytes"] == pytest.approx(1024 * M / 4)
    for n in (4, 1024):  # one fastest engine per worker count, the one with the shortest step
        fastest = [r for r in rows if r["workers"] == n and r["fastest"]]
        assert fastest == [min((r for r in rows if r["workers"] == n), key=lambda r: r["step_s"])]


def test_runs_on_loopback_and_bad_settings_are_refused_by_name(tmp_path):
    run_dir = tmp_path / "lo"
    fake_run(run_dir, "allreduce")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["network"] = {}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="loopback"):
        predict([load_run(run_dir)], ["allreduce/library"], [Target(4, 1e7)])
    out = CliRunner().invoke(predict_cmd, [str(run_dir), "--workers", "4", "--net", "1gbit", "--set", "net.rack=2"])
    assert out.exit_code != 0 and "net.placement" in out.output


def test_validate_predicts_the_larger_runs_from_the_smallest_alone(tmp_path):
    """A 4-worker run whose exchange is exactly the 2-worker run's ratio times the schedule's
    is predicted with no error; one 25% slower, at -20%; the 2-worker runs are not rows."""
    small = fake_run(tmp_path / "ar2", "allreduce", workers=2, compute_s=0.1, step_s=0.5)
    own, four = Target(2, RATE_BITS / 8), Target(4, RATE_BITS / 8)
    ratio = (0.4 - fixed_cost("allreduce/library", own)) / exchange("allreduce/library", own, M)
    exact = 0.1 + ratio * exchange("allreduce/library", four, M) + fixed_cost("allreduce/library", four)
    runs = [small, fake_run(tmp_path / "ar4", "allreduce", workers=4, compute_s=0.1, step_s=exact),
            fake_run(tmp_path / "ar4-slow", "allreduce", workers=4, compute_s=0.1, step_s=1.25 * exact)]
    rows = validate(runs)
    assert [r["workers"] for r in rows] == [4, 4] and all(r["link_bound"] for r in rows)
    assert rows[0]["error"] == pytest.approx(0, abs=1e-9) and rows[1]["error"] == pytest.approx(-0.2)
    assert rows[0]["links_busy"] is None and rows[0]["busiest_links"] is None  # loopback runs: no timeline
    out = CliRunner().invoke(predict_cmd, ["--validate", *(str(r.path) for r in runs)])
    assert out.exit_code == 0 and "link-bound rows: 1 of 2 within 15%, largest error 20.0%" in out.output, out.output
    with pytest.raises(ValueError, match="every run has 2 workers"):
        validate([small])


def test_validate_sets_a_held_out_runs_own_compute_apart_in_its_exchange_error(tmp_path):
    """A 4-worker run whose workers shared the cores (its compute 0.3 s, the calibration's
    0.1) and whose exchange took 0.2 s less than the played one: its step is predicted right,
    its exchange 0.2 s too long, which exchange_error says and the table counts."""
    small = fake_run(tmp_path / "ar2", "allreduce", workers=2, compute_s=0.1, step_s=0.5)
    own, four = Target(2, RATE_BITS / 8), Target(4, RATE_BITS / 8)
    ratio = (0.4 - fixed_cost("allreduce/library", own)) / exchange("allreduce/library", own, M)
    played = ratio * exchange("allreduce/library", four, M) + fixed_cost("allreduce/library", four)
    crowded = fake_run(tmp_path / "ar4", "allreduce", workers=4, compute_s=0.3, step_s=0.1 + played)
    [row] = validate([small, crowded])
    assert row["error"] == pytest.approx(0, abs=1e-9)
    assert row["measured_exchange_s"] == pytest.approx(played - 0.2) and row["measured_compute_s"] == pytest.approx(0.3)
    assert row["host_cpu"] is row["host_cores"] is row["ranks_cores"] is row["shards_cores"] is None  # no cpu.json
    assert row["exchange_error"] == pytest.approx(played / (played - 0.2) - 1)
    out = CliRunner().invoke(predict_cmd, ["--validate", str(small.path), str(crowded.path)])
    assert out.exit_code == 0, out.output
    assert f"{100 * row['exchange_error']:.1f}%" in out.output.splitlines()[1]
    assert "their exchange alone (the played exchange against each run's step less its own compute): 0 of 1 " \
           "within 15%" in out.output, out.output


def test_validate_says_which_rows_dropped_packets_their_calibration_did_not(tmp_path):
    """The held-out run's share of segments sent again stands beside its calibration's; a
    link-bound row outside 15% whose run dropped (1% or more) where its calibration did not is
    named as such; one that dropped no more than its calibration is not."""
    def with_drops(run, share):
        summary = json.loads((run.path / "summary.json").read_text())
        summary["network"]["retransmitted"] = share
        (run.path / "summary.json").write_text(json.dumps(summary))
        return load_run(run.path)

    small = with_drops(fake_run(tmp_path / "ps2", "ps-sync", workers=2, compute_s=0.1, step_s=0.5), 0.0001)
    slow = with_drops(fake_run(tmp_path / "ps4", "ps-sync", workers=4, compute_s=0.1, step_s=2.0), 0.06)
    rows = validate([small, slow])
    assert rows[0]["retransmitted"] == 0.06 and rows[0]["calibration_retransmitted"] == 0.0001
    assert abs(rows[0]["error"]) > 0.15
    out = CliRunner().invoke(predict_cmd, ["--validate", str(small.path), str(slow.path)])
    assert out.exit_code == 0 and "6.00 (0.01)" in out.output, out.output
    assert "1 of them outside 15% sent 1% or more of their segments again" in out.output
    with_drops(small, 0.05)
    out = CliRunner().invoke(predict_cmd, ["--validate", str(small.path), str(slow.path)])
    assert "6.00 (5.00)" in out.output and "of them outside" not in out.output, out.output


def test_a_shard_port_taking_more_hosts_than_the_runs_had_is_noted(tmp_path):
    """ps-sync's fan-in (hosts sending into one shard's port) is each row's, beside the runs'
    highest; the table notes an engine predicted beyond it, once; the ring has none."""
    runs = [fake_run(tmp_path / "ps2", "ps-sync", workers=2), fake_run(tmp_path / "ar2", "allreduce", workers=2)]
    rows = predict(runs, ["ps-sync", "allreduce/library"],
                   [Target(2, RATE_BITS / 8, 2), Target(4, RATE_BITS / 8, 4, "separate"), Target(8, RATE_BITS / 8, 4, "separate")])
    assert [(r["fan_in"], r["calibration_fan_in"]) for r in rows] == [(1, 1), (4, 1), (8, 1), (0, 0), (0, 0), (0, 0)]
    out = CliRunner().invoke(predict_cmd, [str(tmp_path / "ps2"), str(tmp_path / "ar2"), "--workers", "2,4,8",
                                           "--net", "200mbit", "--servers", "4", "--set", "net.placement=separate"])
    assert out.exit_code == 0, out.output
    notes = [line for line in out.output.splitlines() if line.startswith("note:")]
    assert notes == [notes[0]] and "ps-sync with 2 to 8 hosts sending into each shard's port at once, where its " \
        "runs had 1" in notes[0], out.output


def test_the_predict_grid_calibrates_at_2_workers_and_holds_out_the_rest():
    """Every engine runs at 2 workers on 200mbit and at 4 and 8 on the held-out clusters, each
    cell's settings accepted as they stand."""
    from experiments.comparisons.grids import PREDICT_ENGINES, get_comparison
    from experiments.settings.presets import build_config

    grid = get_comparison("predict")
    cells = [(v, n) for v in grid.variants_at(None) for n in v.workers]
    assert len(cells) == len(PREDICT_ENGINES) * 7  # zero on psar's ring in the latency cell too
    seen = set()
    for v, n in cells:
        cfg = build_config(grid.experiment, ("net.rate=200mbit",) + grid.overrides + v.overrides, engine=v.engine,
                           workers=n, servers=v.shards(n), steps=grid.steps)
        seen.add((n, cfg.net.rate, cfg.net.racks, cfg.net.latency_ms))
        assert (n == 2) == (v.overrides == next(e.overrides for e in PREDICT_ENGINES if e.engine == v.engine))
    assert seen == {(2, "200mbit", 1, 0.0), (4, "100mbit", 1, 0.0), (4, "1gbit", 1, 0.0), (4, "2gbit", 1, 0.0),
                    (4, "200mbit", 2, 0.0), (4, "200mbit", 1, 10.0), (8, "200mbit", 1, 0.0)}


def test_a_periodic_schedule_is_measured_by_its_mean_over_whole_periods_without_consensus():
    """Gossip on the one-peer graph of 4 workers alternates its two peers (period 2): steps of
    0.1 and 0.3 s measure 0.2, the consensus measurement left out; the ring's is its median,
    and ps-async's its mean."""
    from pathlib import Path

    from analysis.predict import _measured_step
    from analysis.results import Run

    steps = [0.1, 0.3] * 5 + [0.1]
    records = [{"step": i, "step_s": t + (0.05 if i == 6 else 0.0), "consensus_s": 0.05 if i == 6 else 0.0,
                "comm_s": t, "loss": 1.0, "time": float(i)} for i, t in enumerate(steps)]
    summary = {"workers": 4, "engine": "gossip"}
    gossip = Run(Path("/runs/g"), {"engine": "gossip", "gossip": {"topology": "one-peer-exponential"}}, summary,
                 {r: records for r in range(4)})
    assert gossip.label == "gossip/one-peer-exponential"
    assert _measured_step(gossip) == pytest.approx(0.2)
    flat = [{**r, "step_s": 0.5 if i == 4 else 0.1} for i, r in enumerate(records)]
    ring = Run(Path("/runs/r"), {"engine": "allreduce"}, {**summary, "engine": "allreduce"}, {0: flat})
    assert _measured_step(ring) == pytest.approx(0.1)
    # no step of ps-async waits for every worker: its pace is its mean step
    unsynced = Run(Path("/runs/a"), {"engine": "ps-async"}, {**summary, "engine": "ps-async"}, {0: flat})
    assert _measured_step(unsynced) == pytest.approx((8 * 0.1 + 0.5 + (0.1 - 0.05)) / 10)  # steps 1-10


def test_a_model_of_another_size_moves_its_bytes_and_computes_in_proportion(tmp_path):
    """model.params_mb: twice the runs' bytes moved, and twice their compute."""
    run = fake_run(tmp_path / "ar", "allreduce", workers=2, compute_s=0.1, step_s=0.5)
    target = Target(8, RATE_BITS / 8)
    [plain] = predict([run], ["allreduce/library"], [target])
    [big] = predict([run], ["allreduce/library"], [target], params_bytes=2 * M)
    fixed = fixed_cost("allreduce/library", target)
    assert big["compute_s"] == pytest.approx(2 * plain["compute_s"])
    ratio = (plain["comm_s"] - fixed) / exchange("allreduce/library", target, M)
    assert big["comm_s"] == pytest.approx(exchange("allreduce/library", target, 2 * M) * ratio + fixed)
    out = CliRunner().invoke(predict_cmd, [str(tmp_path / "ar"), "--workers", "8", "--net", "200mbit", "--json",
                                           "--set", f"model.params_mb={2 * M / 1e6}"])
    assert json.loads(out.output)[0]["step_s"] == pytest.approx(big["step_s"])
    bad = CliRunner().invoke(predict_cmd, [str(tmp_path / "ar"), "--workers", "8", "--net", "200mbit",
                                           "--set", "model.params_mb=0"])
    assert bad.exit_code != 0 and "model.params_mb" in bad.output


def test_a_messages_cost_is_read_off_the_targets_bench_report(tmp_path):
    """--bench: half the per-step latency of the report's all-reduce fit (here 40 us a step:
    20 us a message), the same rows as --message-us 20; not both at once."""
    fake_run(tmp_path / "ar", "allreduce", workers=2)
    rows = [{"algorithm": "library", "bytes": b, "time_us": 2 * 40.0 + b * 1e-3} for b in (1024, 65536, 1 << 20)]
    (tmp_path / "bench.json").write_text(json.dumps({"allreduce_table": {"world": 2, "backend": "gloo", "rows": rows}}))
    common = [str(tmp_path / "ar"), "--workers", "8,64", "--net", "10gbit", "--json"]
    read = CliRunner().invoke(predict_cmd, common + ["--bench", str(tmp_path / "bench.json")])
    given = CliRunner().invoke(predict_cmd, common + ["--message-us", "20"])
    assert read.exit_code == 0 and given.exit_code == 0, read.output + given.output
    for a, b in zip(json.loads(read.output), json.loads(given.output)):
        assert a["step_s"] == pytest.approx(b["step_s"], rel=1e-6)
    both = CliRunner().invoke(predict_cmd, common + ["--message-us", "20", "--bench", str(tmp_path / "bench.json")])
    assert both.exit_code != 0 and "not both" in both.output
    (tmp_path / "empty.json").write_text(json.dumps({"ps_bandwidth": [{"bytes": 1024, "ps_us": 100.0},
                                                                   {"bytes": 4096, "ps_us": 110.0}]}))
    none = CliRunner().invoke(predict_cmd, common + ["--bench", str(tmp_path / "empty.json")])
    assert none.exit_code != 0 and "has no all-reduce rows" in none.output


def test_validate_takes_the_runs_machines_message_cost(tmp_path):
    """--validate --message-us: the calibration sets apart, and the held-out row adds, the
    given cost of a message (2(N-1) hops, a message sent and one received each), where it
    ignored it before; the 2-worker run is still its measured step."""
    small = fake_run(tmp_path / "ar2", "allreduce", workers=2, compute_s=0.1, step_s=0.5)
    big = fake_run(tmp_path / "ar4", "allreduce", workers=4, compute_s=0.1, step_s=0.9)
    own, four = Target(2, RATE_BITS / 8, message=1e-3), Target(4, RATE_BITS / 8, message=1e-3)
    ratio = (0.4 - fixed_cost("allreduce/library", own)) / exchange("allreduce/library", own, M)
    expected = 0.1 + ratio * exchange("allreduce/library", four, M) + fixed_cost("allreduce/library", four)
    [row] = validate([small, big], message=1e-3)
    assert row["step_s"] == pytest.approx(expected)
    assert row["step_s"] != pytest.approx(validate([small, big])[0]["step_s"])  # the default's 250 us
    out = CliRunner().invoke(predict_cmd, ["--validate", "--message-us", "1000", "--json", str(small.path), str(big.path)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)[0]["step_s"] == pytest.approx(expected)


def test_the_grids_report_validates_with_the_message_cost_measured_before_it(tmp_path):
    """`psar compare predict` measures a message's cost first (out/bench.json): its report's
    rows are validate's with that cost, and its header says so; without the file, the default."""
    from analysis.validation import report
    from test_costmodel import allreduce_table

    from analysis.costmodel import Fit

    runs = [fake_run(tmp_path / "ar2", "allreduce", workers=2, compute_s=0.1, step_s=0.5),
            fake_run(tmp_path / "ar4", "allreduce", workers=4, compute_s=0.1, step_s=0.9)]
    text, [path] = report(runs, tmp_path)
    assert "a message" not in text.splitlines()[0]
    assert json.loads(path.read_text())[0]["step_s"] == pytest.approx(validate(runs)[0]["step_s"])
    (tmp_path / "bench.json").write_text(json.dumps({"allreduce_table": allreduce_table(2, {"library": Fit(2e-3, 1e-9)})}))
    text, [path] = report(runs, tmp_path)
    assert "a message 1000 us" in text.splitlines()[0]  # half the fitted per-step alpha
    assert json.loads(path.read_text())[0]["step_s"] == pytest.approx(validate(runs, message=1e-3)[0]["step_s"])


def test_validate_plays_the_runs_machines_fabric_and_the_grids_report_reads_it(tmp_path):
    """One machine's kernel carries every emulated link: given what they carry at once
    (fabric), the calibration and each held-out row are played with it, so that a 4-worker
    ring whose links would move more than it does is predicted longer; the grid's report
    reads it off bench.json (machine.py's `fabric`) and names it; --validate takes it by
    --set net.fabric or from --bench, not both."""
    from analysis.predict import bench_fabric, calibration
    from analysis.validation import report
    from test_costmodel import allreduce_table

    from analysis.costmodel import Fit

    small = fake_run(tmp_path / "ar2", "allreduce", workers=2, compute_s=0.1, step_s=0.5)
    big = fake_run(tmp_path / "ar4", "allreduce", workers=4, compute_s=0.1, step_s=0.9)
    fabric = 2 * RATE_BITS / 8  # the 2 hosts' links together; 4 hosts would send twice that
    [unlimited], [carried] = validate([small, big]), validate([small, big], fabric=fabric)
    _, ratio, _ = calibration(small, fabric=fabric)
    four = Target(4, RATE_BITS / 8, fabric=fabric)
    expected = 0.1 + ratio * exchange("allreduce/library", four, M) + fixed_cost("allreduce/library", four)
    assert carried["step_s"] == pytest.approx(expected)
    assert carried["comm_s"] > 1.5 * unlimited["comm_s"]
    bench = {"allreduce_table": allreduce_table(2, {"library": Fit(2e-3, 1e-9)}),
             "fabric": {"hosts": 4, "rate": "2gbit", "bytes_per_s": fabric}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    assert bench_fabric(tmp_path / "bench.json") == fabric
    text, [path] = report([small, big], tmp_path)
    assert f"the links {fabric / 1e6:.0f} MB/s all together" in text.splitlines()[0]
    assert json.loads(path.read_text())[0]["step_s"] == pytest.approx(
        validate([small, big], message=1e-3, fabric=fabric)[0]["step_s"])
    runs = [str(small.path), str(big.path)]
    by_set = CliRunner().invoke(predict_cmd, ["--validate", "--json", "--message-us", "1000",
                                              "--set", f"net.fabric={fabric * 8:.0f}bit", *runs])
    by_bench = CliRunner().invoke(predict_cmd, ["--validate", "--json", "--bench", str(tmp_path / "bench.json"), *runs])
    assert by_set.exit_code == 0 and by_bench.exit_code == 0, by_set.output + by_bench.output
    assert json.loads(by_set.output)[0]["step_s"] == pytest.approx(json.loads(by_bench.output)[0]["step_s"])
    both = CliRunner().invoke(predict_cmd, ["--validate", "--bench", str(tmp_path / "bench.json"),
                                            "--set", "net.fabric=1gbit", *runs])
    assert both.exit_code != 0 and "not both" in both.output
    bad = CliRunner().invoke(predict_cmd, ["--validate", "--set", "net.fabric=fast", *runs])
    assert bad.exit_code != 0 and "net.fabric='fast'" in bad.output
    (tmp_path / "bad.json").write_text(json.dumps({**bench, "fabric": {"bytes_per_s": -1}}))
    with pytest.raises(ValueError, match="fabric.bytes_per_s"):
        bench_fabric(tmp_path / "bad.json")


def test_psar_own_collectives_take_the_cost_of_a_message_on_its_ring(tmp_path):
    """psar's own all-reduce algorithms and ZeRO on psar's ring cost a message what the bench's
    ring fit says, the backend's collectives what its library fit says: each run is calibrated
    and predicted as if that were the one cost given. The report names both."""
    from analysis.costmodel import Fit
    from analysis.predict import bench_message
    from analysis.validation import report
    from test_costmodel import allreduce_table

    def zero_on_ring(path, workers, step_s):
        run = fake_run(path, "zero", workers=workers, compute_s=0.1, step_s=step_s)
        config = json.loads((path / "config.json").read_text())
        config["zero"]["algorithm"] = "ring"
        (path / "config.json").write_text(json.dumps(config))
        return load_run(path)

    cases = {"allreduce/library": ([fake_run(tmp_path / f"lib{n}", "allreduce", workers=n, compute_s=0.1, step_s=s)
                                    for n, s in ((2, 0.5), (4, 0.9))], 1e-4),
             "allreduce/ring": ([fake_run(tmp_path / f"ring{n}", "allreduce", algorithm="ring", workers=n,
                                          compute_s=0.1, step_s=s) for n, s in ((2, 0.5), (4, 0.9))], 1e-3),
             "zero-1": ([zero_on_ring(tmp_path / f"zero{n}", n, s) for n, s in ((2, 0.5), (4, 0.9))], 1e-3)}
    for label, (runs, cost) in cases.items():
        [row] = validate(runs, message=1e-4, own_message=1e-3)
        [alone] = validate(runs, message=cost)
        assert row["engine"] == label and row["step_s"] == pytest.approx(alone["step_s"]), label
    assert validate(cases["allreduce/ring"][0], message=1e-4)[0]["step_s"] != \
        pytest.approx(validate(cases["allreduce/ring"][0], message=1e-3)[0]["step_s"])
    fits = {"library": Fit(2e-3, 1e-9), "ring": Fit(4e-3, 1e-9)}
    (tmp_path / "bench.json").write_text(json.dumps({"allreduce_table": allreduce_table(2, fits)}))
    assert bench_message(tmp_path / "bench.json") == pytest.approx(1e-3)
    assert bench_message(tmp_path / "bench.json", own=True) == pytest.approx(2e-3)
    text, _ = report(cases["zero-1"][0], tmp_path)
    assert "a message 1000 us (2000 in psar's own collectives)" in text.splitlines()[0]


def test_a_shards_own_time_is_read_off_the_bench_reports_legs_and_slows_only_the_parameter_servers(tmp_path):
    """bench.json's ps_legs (its thread's CPU a push+pull at each size, else its receive to
    its send) fit a shard's time: a message's and a byte's; without legs, (None, None) and the
    defaults. With a shard ten times slower on a fast cluster, ps-sync's predicted step grows
    and the ring's does not."""
    from analysis.predict import SHARD_BYTE_S, SHARD_MESSAGE_S, bench_shard

    legs = [{"bytes": b, "ps_server_us": 10.0 + 100.0 * b / 2**20} for b in (1024, 1 << 20, 4 << 20)]
    rows = [{"algorithm": "library", "bytes": b, "time_us": 80.0 + b * 1e-3} for b in (1024, 65536, 1 << 20)]
    (tmp_path / "bench.json").write_text(json.dumps({"ps_legs": legs,
                                                    "allreduce_table": {"world": 2, "backend": "gloo", "rows": rows}}))
    message, byte = bench_shard(tmp_path / "bench.json")
    assert message == pytest.approx(10e-6) and byte == pytest.approx(100e-6 / 2**20)
    for r in legs:  # the thread's CPU, where the legs hold it, over the receive-to-send
        r["ps_thread_us"] = 40.0 + 120.0 * r["bytes"] / 2**20
    (tmp_path / "thread.json").write_text(json.dumps({"ps_legs": legs}))
    message, byte = bench_shard(tmp_path / "thread.json")
    assert message == pytest.approx(40e-6) and byte == pytest.approx(120e-6 / 2**20)
    (tmp_path / "none.json").write_text(json.dumps({"ps_legs": legs[:1]}))
    assert bench_shard(tmp_path / "none.json") == (None, None)
    target = Target(64, 50e9 / 8, 4, "separate")
    assert target.cluster("ps").shard_message == SHARD_MESSAGE_S and target.cluster("ps").shard_byte == SHARD_BYTE_S
    assert target.cluster("ring").shard_message == 0 and target.cluster("ring").shard_byte == 0

    fake_run(tmp_path / "ar", "allreduce", workers=2)
    fake_run(tmp_path / "ps", "ps-sync", workers=2)
    common = [str(tmp_path / "ar"), str(tmp_path / "ps"), "--workers", "64", "--net", "400gbit", "--servers", "4",
              "--set", "net.placement=separate", "--json"]
    legs = [{"bytes": b, "ps_server_us": 10 * (SHARD_MESSAGE_S + SHARD_BYTE_S * b) * 1e6} for b in (1024, 1 << 20)]
    (tmp_path / "slow.json").write_text(json.dumps({"ps_legs": legs,
                                                   "allreduce_table": {"world": 2, "backend": "gloo", "rows": rows}}))
    steps = {}
    for name in ("bench.json", "slow.json"):
        out = CliRunner().invoke(predict_cmd, common + ["--bench", str(tmp_path / name)])
        assert out.exit_code == 0, out.output
        steps[name] = {r["engine"]: r["step_s"] for r in json.loads(out.output)}
    assert steps["slow.json"]["ps-sync"] > steps["bench.json"]["ps-sync"]
    assert steps["slow.json"]["allreduce/library"] == pytest.approx(steps["bench.json"]["allreduce/library"])
