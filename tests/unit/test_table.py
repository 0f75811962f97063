"""The comparison table on hand-written runs: one row per grid cell, repeats summarised by
their median and range, and a note wherever a figure is missing or rests on little."""

from __future__ import annotations

from pathlib import Path

from analysis.results import Run
from analysis.table import failed_rows, markdown, rows


def _run(engine: str, workers: int, rate: float | None, steps: int = 20, loss: float = 1.0) -> Run:
    summary = dict(experiment="quickstart", engine=engine, workers=workers, servers=1, samples_per_sec=rate,
                   final_loss=loss, eval={"accuracy": 0.5}, bytes_per_worker_per_step=2e6)
    records = [dict(step=s, comm_s=0.25, step_s=1.0, loss=loss) for s in range(steps)]
    return Run(Path(f"/runs/{engine}-{workers}-{rate}"), {}, summary, {0: records})


def test_repeats_of_a_cell_are_one_row_with_median_and_range():
    table = rows([_run("allreduce", 1, 100.0), _run("allreduce", 2, 100.0, loss=2.0),
                  _run("allreduce", 2, 300.0, loss=4.0), _run("allreduce", 2, 260.0, loss=3.0)])
    one, two = table
    assert (one["runs"], one["samples_per_sec"], one["samples_per_sec_range"]) == (None, 100.0, None)
    assert (two["runs"], two["samples_per_sec"], two["samples_per_sec_range"]) == (3, 260.0, "100-300")
    assert two["speedup"] == 2.6 and two["final_loss"] == 3.0 and two["comm_share"] == 0.25
    text = markdown(table)
    assert "| runs |" in text and "| samples/s range |" in text and "| 2 |  | 3 | 260 | 100-300 |" in text


def test_notes_say_why_a_figure_is_missing_or_thin_and_empty_columns_are_left_out():
    plain = markdown(rows([_run("ps-sync", 2, 500.0)]))
    assert "runs" not in plain and "range" not in plain and "note" not in plain
    table = rows([_run("ps-async", 2, None), _run("local", 1, 50.0, steps=6)])
    notes = {row["engine"]: row["note"] for row in table}
    assert notes == {"ps-async": "no samples/s: the workers never trained at the same time past their first step",
                     "local": "samples/s from 5 steps only"}
    failed = failed_rows([{"engine": "ddp", "workers": 2, "servers": "", "error": "rank 1 exited\nmore"}])
    assert failed[0]["note"] == "failed: rank 1 exited" and "| ddp | 2 |" in markdown(failed)


def test_time_to_target_needs_the_loss_held_over_five_steps():
    from analysis.results import time_to_target

    losses = [2.0, 1.0, 0.1, 2.0, 2.0, 0.5, 0.5, 0.4, 0.4, 0.4, 0.4, 0.3]
    records = {rank: [dict(step=s, loss=loss + 0.1 * rank, time=float(s + 1 + rank), comm_s=0.0, step_s=1.0)
                      for s, loss in enumerate(losses)] for rank in (0, 1)}
    run = Run(Path("/runs/x"), {"target_loss": 0.5}, {"engine": "ps-sync", "workers": 2, "servers": 1,
                                                       "samples_per_sec": 1.0, "final_loss": 0.3, "eval": {},
                                                       "bytes_per_worker_per_step": 0}, records)
    # Step 2's lucky batch (mean over ranks 0.15) is not the target reached: the 5-step mean of
    # the worker means first gets to 0.5 over steps 5..9 (0.55 0.55 0.45 0.45 0.45: 0.49), so
    # 10 steps, done by both ranks at rank 1's time for step 9.
    assert time_to_target(run) == (10, 11.0)
    assert time_to_target(run, 0.01) is None and time_to_target(run, 0.0) is None
    row, = rows([run])
    assert (row["steps_to_target"], row["time_to_target_s"]) == (10, 11.0)
    assert "| steps to target | time to target (s) |" in markdown([row])
    assert rows([Run(run.path, {"target_loss": 0.01}, run.summary, records)])[0]["steps_to_target"] == "not reached"


def test_where_the_shards_were_and_how_they_answered_tell_cells_apart():
    from analysis.table import cell_of

    def ps(config: dict, network: dict | None) -> Run:
        summary = dict(engine="ps-sync", workers=4, servers=4, network=network)
        return Run(Path("/runs/ps"), config, summary, {})

    net = {"rate": "200mbit", "placement": "colocated"}
    pipelined, phased = ps({}, net), ps({"ps": {"exchange": "phased"}}, net)
    assert (pipelined.placement, phased.placement) == ("colocated", "colocated, phased")
    assert cell_of(pipelined) == ("ps-sync", 4, "4 colocated") and cell_of(phased) == ("ps-sync", 4, "4 colocated, phased")
    assert ps({"ps": {"exchange": "phased"}}, None).placement is None  # loopback: no hosts to place on
    assert _run("allreduce", 2, 1.0).placement is None


def test_runs_that_compress_differently_are_different_cells_never_repeats():
    def run(config: dict, rate: float, engine: str = "allreduce") -> Run:
        plain = _run(engine, 2, rate)
        return Run(plain.path, config, plain.summary, plain.metrics)

    table = rows([run({}, 100.0), run({"compress": {"method": "topk", "ratio": 0.01}}, 300.0),
                  run({"allreduce": {"compression": "fp16"}}, 200.0),
                  run({"compress": {"method": "qsgd", "levels": 4, "error_feedback": False}}, 150.0),
                  run({"ps": {"compression": "bf16"}}, 50.0, engine="ps-sync")])
    assert [(r["engine"], r["samples_per_sec"]) for r in table] == [
        ("allreduce/library", 100.0), ("allreduce/library +fp16", 200.0),
        ("allreduce/library +qsgd 4 no EF", 150.0), ("allreduce/library +topk 0.01", 300.0),
        ("ps-sync +bf16", 50.0)]


def test_the_verdict_names_the_fastest_engine_and_whether_repeats_tell_them_apart():
    from analysis.verdict import verdicts

    clear = [_run("allreduce", 2, r) for r in (100.0, 110.0, 105.0)] + \
            [_run("ps-sync", 2, r) for r in (60.0, 62.0, 61.0)] + [_run("local", 2, 999.0)]
    (line,) = verdicts(clear)
    assert line.startswith("verdict, 2 workers on loopback: allreduce/library fastest at 105 samples/s "
                           "(range 100-110 over 3 runs); ps-sync (1 shard) 0.58x")
    assert "overlap" not in line and "local" not in line  # one process: the reference, not a contender
    close = [_run("allreduce", 2, r) for r in (100.0, 110.0)] + [_run("ddp", 2, r) for r in (95.0, 104.0)]
    assert "ddp 0.95x (ranges overlap: not told apart)" in verdicts(close)[0]
    assert "one run each" in verdicts([_run("allreduce", 2, 100.0), _run("ddp", 2, 90.0)])[0]
    assert verdicts([_run("allreduce", 1, 100.0), _run("ddp", 1, 90.0)]) == []  # 1 worker: nothing to decide


def _configured(name: str, config: dict, rate: float) -> Run:
    summary = dict(experiment="quickstart", engine="ps-sync", workers=2, servers=1, samples_per_sec=rate,
                   final_loss=1.0, eval={}, bytes_per_worker_per_step=2e6)
    records = [dict(step=s, comm_s=0.25, step_s=1.0, loss=1.0, wall=float(s), time=float(s)) for s in range(8)]
    return Run(Path(f"/runs/{name}"), config, summary, {0: records})


def test_runs_that_differ_in_a_setting_or_argument_are_never_one_row():
    """Two repeats of one configuration are one row; a run that differs from them in a
    setting (ps.order) or a script argument is a row of its own, named by what differs, in
    the table, the verdict and the figures' names."""
    from analysis import style
    from analysis.verdict import verdicts

    script = {"model": {"_type": "ScriptConfig", "path": "train.py", "args": ["--clip", "1.0"]}}
    forward = {**script, "ps": {"order": "forward"}}
    runs = [_configured("a", forward, 100.0), _configured("b", forward, 110.0),
            _configured("c", {**script, "ps": {"order": "arrival"}}, 90.0),
            _configured("d", {"model": {**script["model"], "args": ["--clip", "0"]}, "ps": {"order": "forward"}}, 80.0)]
    table = rows(runs)
    by_name = {row["engine"]: row for row in table}
    assert set(by_name) == {'ps-sync [model.args=["--clip", "1.0"], ps.order=forward]',
                            'ps-sync [model.args=["--clip", "1.0"], ps.order=arrival]',
                            'ps-sync [model.args=["--clip", "0"], ps.order=forward]'}
    assert by_name['ps-sync [model.args=["--clip", "1.0"], ps.order=forward]']["runs"] == 2
    line, = verdicts(runs)
    assert 'ps.order=arrival] (1 shard) 0.86x' in line and 'model.args=["--clip", "0"]' in line
    names = style.names(runs, workers=True)
    assert names[Path("/runs/a")] == names[Path("/runs/b")] != names[Path("/runs/c")] != names[Path("/runs/d")]
    assert rows(runs[:2])[0]["engine"] == "ps-sync"  # nothing differs: the plain name


def test_the_hosts_tcp_tells_runs_apart_only_on_an_emulated_network():
    """net.congestion's default changed from "" to a list: loopback runs from before and after
    are repeats of one cell; on an emulated network, runs whose hosts ran other TCP are not."""
    loopback = [_configured("old", {"net": {"rate": "", "congestion": ""}}, 100.0),
                _configured("new", {"net": {"rate": "", "congestion": "cubic,reno"}}, 110.0)]
    assert [row["runs"] for row in rows(loopback)] == [2]
    shaped = [_configured("bbr", {"net": {"rate": "100mbit", "congestion": "bbr"}}, 100.0),
              _configured("reno", {"net": {"rate": "100mbit", "congestion": "cubic,reno"}}, 110.0)]
    assert {row["engine"] for row in rows(shaped)} == {"ps-sync [net.congestion=bbr]",
                                                        "ps-sync [net.congestion=cubic,reno]"}


def test_runs_on_links_built_otherwise_are_never_one_row():
    """summary.json's network records the links' burst and packets: runs on the 4 ms links
    (which recorded neither) and on today's are two rows; repeats on today's links, one."""
    net = {"net": {"rate": "1gbit"}}
    built = {"network": {"burst_bytes": 125_000, "packet_bytes": 65_536}}
    old = _configured("old", net, 100.0)
    new = [_configured(name, net, rate) for name, rate in (("new", 110.0), ("again", 120.0))]
    for run in new:
        run.summary.update(built)
    from analysis.results import distinctions

    apart = distinctions([old, *new], lambda run: run.label)
    assert apart == {Path("/runs/old"): "net.burst_bytes=-, net.packet_bytes=-",
                     Path("/runs/new"): "net.burst_bytes=125000, net.packet_bytes=65536",
                     Path("/runs/again"): "net.burst_bytes=125000, net.packet_bytes=65536"}
    assert set(distinctions(new, lambda run: run.label).values()) == {""}


def test_the_verdict_counts_shards_in_words():
    from analysis.verdict import _name

    assert _name("ps-sync", "1 separate") == "ps-sync (1 separate shard)"
    assert _name("ps-sync", "4 separate") == "ps-sync (4 separate shards)"
    assert _name("ps-sync", 1) == "ps-sync (1 shard)" and _name("ps-sync", 2) == "ps-sync (2 shards)"
    assert _name("allreduce/ring", "") == "allreduce/ring"


def test_the_legend_says_which_statistic_each_shown_column_is():
    from analysis.table import legend

    table = rows([_run("allreduce", 2, 100.0), _run("allreduce", 2, 120.0)])
    text = legend(table)
    assert "- samples/s: " in text and "median over the cell's runs" in text
    assert "- samples/s range: slowest to fastest" in text
    assert "- step (s)" not in text  # no step column without a network: no line for it
