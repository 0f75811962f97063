"""`psar predict` with an all-reduce's and a parameter server's buckets released as backward produced them
(analysis/overlap.py): the calibration gives the run's own measured step back, other clusters
play each bucket from when it was ready, and a run whose buckets were all ready at the end of
backward is predicted as one without the record."""

from __future__ import annotations

import json

import pytest

from analysis.overlap import Timeline, exposed, median_timeline, solve_ratio, timeline
from analysis.schedules import Cluster, parameter_server_pipelined, released
from analysis.predict import Target, calibration, exchange, exposed_exchange, fixed_cost, predict
from analysis.results import load_run
from test_labels import M, RATE_BITS, fake_run

LABEL = "allreduce/library"


def with_buckets(run, backward_s, buckets):
    """run's metrics with every step recording backward_s and buckets [[seconds, bytes]]."""
    for path in (run.path / "metrics").glob("rank*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "backward_s": backward_s, "buckets": buckets}) + "\n" for r in lines))
    return load_run(run.path)


def test_buckets_ready_during_backward_hide_their_exchange(tmp_path):
    run = with_buckets(fake_run(tmp_path / "ar", "allreduce", compute_s=0.1, step_s=0.5), 0.08,
                       [[0.02, M // 2], [0.08, M - M // 2]])
    line = timeline(run)
    assert line == Timeline(0.08, ((0.02, 0.5), (0.08, 0.5)))
    own, faster = Target(2, RATE_BITS / 8), Target(4, 10 * RATE_BITS / 8)
    rows = {r["workers"]: r for r in predict([run], [LABEL], [own, faster])}
    assert rows[2]["step_s"] == pytest.approx(0.5, rel=1e-9)  # the ratio gives the run's own wait after backward

    def bucket(target, ratio):
        return exchange(LABEL, target, M / 2) * ratio + fixed_cost(LABEL, target)

    ratio = solve_ratio(lambda r: exposed(line, lambda share: r * exchange(LABEL, own, share * M)
                                          + fixed_cost(LABEL, own)), 0.4)
    first = 0.02 + bucket(faster, ratio)
    assert rows[4]["comm_s"] == pytest.approx(max(0.08, first) + bucket(faster, ratio) - 0.08)
    # The same run without its record plays the exchange after backward, whole: longer here.
    plain = fake_run(tmp_path / "plain", "allreduce", compute_s=0.1, step_s=0.5)
    [whole] = predict([plain], [LABEL], [faster])
    assert rows[4]["comm_s"] < whole["comm_s"]


def test_one_bucket_ready_at_the_end_of_backward_is_the_plain_prediction(tmp_path):
    run = with_buckets(fake_run(tmp_path / "ar", "allreduce", compute_s=0.1, step_s=0.5), 0.05, [[0.05, M]])
    plain = fake_run(tmp_path / "plain", "allreduce", compute_s=0.1, step_s=0.5)
    targets = [Target(n, RATE_BITS / 8 * k) for n in (2, 8, 64) for k in (1, 10)]
    for a, b in zip(predict([run], [LABEL], targets), predict([plain], [LABEL], targets)):
        assert a["step_s"] == pytest.approx(b["step_s"], rel=1e-9)


def test_a_timeline_needs_every_step_to_agree_on_its_buckets(tmp_path):
    run = with_buckets(fake_run(tmp_path / "ar", "allreduce"), 0.05, [[0.01, 100], [0.05, 200]])
    path = run.path / "metrics" / "rank1.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[2]["buckets"] = [[0.05, 300]]  # a step that started other buckets
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert timeline(load_run(run.path)) is None
    assert timeline(fake_run(tmp_path / "none", "allreduce")) is None  # no record


def test_exposed_plays_buckets_in_order_from_when_each_is_ready():
    line = Timeline(1.0, ((0.0, 0.25), (0.5, 0.25), (1.0, 0.5)))
    # 0.25 of the bytes take 0.3 s: the first ends at 0.3, the second starts at 0.5 and ends at
    # 0.8, the third starts at 1.0 and ends at 1.6: 0.6 s after backward.
    assert exposed(line, lambda share: 1.2 * share) == pytest.approx(0.6)
    assert exposed(line, lambda share: 0.0) == 0.0
    # Slow buckets queue behind each other: 4 s a step's bytes, the last ends at 4 s.
    assert exposed(line, lambda share: 4 * share) == pytest.approx(3.0)
    assert solve_ratio(lambda r: exposed(line, lambda share: r * 1.2 * share), 0.6) == pytest.approx(1.0)
    # Where backward hid it all, the least ratio that leaves anything; where the fixed costs
    # alone leave more than was measured, 0; where nothing is played (one worker), the ideal.
    hidden = Timeline(1.0, ((0.0, 0.5), (0.5, 0.5)))
    assert solve_ratio(lambda r: exposed(hidden, lambda share: r * share), 0.0) == pytest.approx(1.0, rel=1e-6)
    assert solve_ratio(lambda r: exposed(line, lambda share: 0.1 + r * share), 0.05) == 0.0
    assert solve_ratio(lambda r: 0.0, 0.01) == 1.0


def test_a_parameter_servers_keys_leave_no_sooner_than_backward_released_them(tmp_path):
    """ps-sync on 2 separate shards: keys released as backward goes leave during it, so less
    is left after it than when every key leaves at its end; the run's own step comes back."""
    cluster = Cluster(2, RATE_BITS / 8, servers=2)
    late = parameter_server_pipelined(cluster, M, 2, M / 8, 0, ((0.05, 1.0),))
    assert late == pytest.approx(0.05 + parameter_server_pipelined(cluster, M, 2, M / 8))  # all at once, later
    early = parameter_server_pipelined(cluster, M, 2, M / 8, 0, ((0.0, 0.5), (0.05, 0.5)))
    assert early < late
    assert released(4, ((0.0, 0.5), (0.05, 0.5))) == [0.0, 0.0, 0.05, 0.05]
    assert released(3, ((0.01, 0.2), (0.02, 0.3), (0.03, 0.5))) == [0.02, 0.03, 0.03]
    run = with_buckets(fake_run(tmp_path / "ps", "ps-sync", compute_s=0.1, step_s=0.5), 0.05,
                       [[0.0, M // 2], [0.05, M - M // 2]])
    [row] = predict([run], ["ps-sync"], [Target(2, RATE_BITS / 8, 2)])  # its own cluster: 2 co-located shards
    assert row["step_s"] == pytest.approx(0.5, rel=1e-6)


def test_predict_notes_a_calibration_run_that_waited_little_after_backward(tmp_path):
    from click.testing import CliRunner

    from experiments.cli.predicting import predict_cmd

    fake_run(tmp_path / "hidden", "allreduce", compute_s=0.4, step_s=0.5)  # waited 20% of its step
    fake_run(tmp_path / "bound", "ps-sync", compute_s=0.1, step_s=0.5)  # 80%
    out = CliRunner().invoke(predict_cmd, [str(tmp_path / "hidden"), str(tmp_path / "bound"), "--workers", "8",
                                           "--net", "1gbit"])
    assert out.exit_code == 0, out.output
    notes = [line for line in out.output.splitlines() if "after backward" in line]
    assert notes == ["note: allreduce/library's runs waited at most 20% of their step after backward: its ratio is "
                     "read off that remainder, which the run-to-run spread of its compute moves far (calibrate on a "
                     "run whose exchange its link bounds: at least 50% of the step)"]


def test_zero_plays_its_reduce_scatters_in_backward_and_its_all_gather_after(tmp_path):
    run = with_buckets(fake_run(tmp_path / "z", "zero", compute_s=0.1, step_s=0.5, stage=1), 0.08,
                       [[0.02, M // 2], [0.08, M - M // 2]])
    own, faster = Target(2, RATE_BITS / 8), Target(4, 10 * RATE_BITS / 8)
    rows = {r["workers"]: r for r in predict([run], ["zero-1"], [own, faster])}
    assert rows[2]["step_s"] == pytest.approx(0.5, rel=1e-6)

    def half(target, share, ratio):
        return (exchange("zero-1", target, share * M) * ratio + fixed_cost("zero-1", target)) / 2

    def gathers(target, ratio):  # one all-gather a bucket, after the step
        return exchange("zero-1", target, M) * ratio / 2 + 2 * fixed_cost("zero-1", target) / 2

    ratio = solve_ratio(lambda r: exposed(timeline(run), lambda share: half(own, share, r)) + gathers(own, r), 0.4)
    first = 0.02 + half(faster, 0.5, ratio)
    rs_after = max(0.08, first) + half(faster, 0.5, ratio) - 0.08
    assert rows[4]["comm_s"] == pytest.approx(rs_after + gathers(faster, ratio))
    staged = with_buckets(fake_run(tmp_path / "z3", "zero", stage=3), 0.08, [[0.08, M]])
    assert calibration(staged)[2] is None  # stage 3 gathers in forward: not played so


def test_on_racks_the_ratio_slows_the_uplinks_too(tmp_path):
    """A parameter server's run on two racks behind a slower uplink, predicted on its own
    cluster, gives its own step back: the calibration's slowdown applies to every link."""
    run = with_buckets(fake_run(tmp_path / "ps", "ps-sync", workers=4, compute_s=0.1, step_s=0.9), 0.05,
                       [[0.0, M // 2], [0.05, M - M // 2]])
    config, summary = (json.loads((run.path / f).read_text()) for f in ("config.json", "summary.json"))
    config["net"] |= {"racks": 2, "placement": "separate"}
    summary["network"] |= {"uplink_bits": RATE_BITS / 4}
    (run.path / "config.json").write_text(json.dumps(config))
    (run.path / "summary.json").write_text(json.dumps(summary))
    run = load_run(run.path)
    racks = Target(4, RATE_BITS / 8, 2, "separate", 2, RATE_BITS / 4 / 8)
    [row] = predict([run], ["ps-sync"], [racks])
    assert row["step_s"] == pytest.approx(0.9, rel=1e-6)
    # Twice as slow as played is the played exchange on hosts and uplinks of half the rate.
    line, ps = timeline(run), {"chunk_mb": 0.125, "window_mb": 0}  # keys and window whatever the rate
    halved = Target(4, RATE_BITS / 16, 2, "separate", 2, RATE_BITS / 4 / 16)
    assert exposed_exchange("ps-sync", racks, M, ps, line, 2.0) == pytest.approx(
        exposed_exchange("ps-sync", halved, M, ps, line, 1.0))


def test_an_engines_runs_are_played_one_way(tmp_path):
    """One run with the record and one without: both are played whole, as runs without it;
    two with the record: their median timeline."""
    a = with_buckets(fake_run(tmp_path / "a", "allreduce", compute_s=0.1, step_s=0.5), 0.08, [[0.02, M]])
    b = fake_run(tmp_path / "b", "allreduce", compute_s=0.1, step_s=0.6)
    plain_a = fake_run(tmp_path / "pa", "allreduce", compute_s=0.1, step_s=0.5)
    target = [Target(8, 10 * RATE_BITS / 8)]
    assert predict([a, b], [LABEL], target)[0]["step_s"] == pytest.approx(predict([plain_a, b], [LABEL], target)[0]["step_s"])
    c = with_buckets(fake_run(tmp_path / "c", "allreduce", compute_s=0.1, step_s=0.5), 0.1, [[0.04, M]])
    assert median_timeline([timeline(a), timeline(c)]) == Timeline(0.09, ((0.03, 1.0),))
