"""The links' timeline of an emulated run (experiments/runtime/linkmeter.py) and what `psar
links` makes of it (analysis/links.py), on made-up counters."""

from __future__ import annotations

import json

import pytest

from analysis.links import busy, carried, links_busy, steps, table
from analysis.results import load_run
from experiments.runtime import meter as meters
from experiments.runtime.linkmeter import LINKS_FILE, LinkMeter, read_dev, series
from experiments.runtime.meter import as_timeline

DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:       5       1    0    0    0     0          0         0        5       1    0    0    0     0       0          0
    p0:     100       2    0    0    0     0          0         0      700       9    0    0    0     0       0          0
    p1:     300       4    0    0    0     0          0         0      500       7    0    0    0     0       0          0
   up0:      11       1    0    0    0     0          0         0       22       1    0    0    0     0       0          0
 down0:      33       1    0    0    0     0          0         0       44       1    0    0    0     0       0          0
  eth0:       1       1    0    0    0     0          0         0        1       1    0    0    0     0       0          0
"""


def test_the_ports_counters_are_read_as_what_each_host_sent_and_received():
    counters = read_dev(DEV)
    assert counters == {"p0": (100, 700), "p1": (300, 500), "up0": (11, 22), "down0": (33, 44)}
    assert series(("w0", "s0"), counters) == {"w0 sent": 100, "w0 received": 700, "s0 sent": 300,
                                              "s0 received": 500, "up:r0": 22, "down:r0": 44}
    with pytest.raises(ValueError, match="p1"):
        read_dev(DEV.replace("    p1:     300       4    0    0", "    p1:     300"))


def test_a_long_timeline_keeps_the_first_and_last_readings_and_every_byte():
    rows = [(10 + 3 * i,) for i in range(10)]
    out = as_timeline([float(i) for i in range(10)], rows, ("w0 sent",), 0.01, most=4)
    assert out["interval_s"] == pytest.approx(0.04)
    assert out["t"][0] == 0.0 and out["t"][-1] == 9.0 and len(out["t"]) <= 4
    assert out["links"]["w0 sent"][0] == 0 and out["links"]["w0 sent"][-1] == 27
    assert as_timeline([0.0, 1.0], rows[:2], ("w0 sent",), 0.01)["links"]["w0 sent"] == [0, 3]


def test_a_port_gone_from_a_reading_keeps_its_count_and_a_long_run_is_thinned_as_it_goes(monkeypatch):
    meter = LinkMeter("none", ("w0",))
    meter._take(1.0, {"w0 sent": 5, "w0 received": 7})
    meter._take(2.0, {"w0 sent": 9})  # its host's namespace went first
    assert meter.timeline()["links"] == {"w0 received": [0, 0], "w0 sent": [0, 4]}
    monkeypatch.setattr(meters, "MAX_READINGS", 4)
    for i in range(3, 12):
        meter._take(float(i), {"w0 sent": 9 + i, "w0 received": 7})
    assert len(meter._rows) <= 8 and meter._times[0] == 1.0 and meter._times[-1] == 11.0
    out = meter.timeline()
    assert out["links"]["w0 sent"][-1] == 15 and len(out["t"]) <= 4 and out["interval_s"] > meter.interval_s


def test_a_port_first_seen_later_counts_from_there_and_a_process_from_its_start(tmp_path):
    from experiments.runtime.cpumeter import CpuMeter

    links = LinkMeter("none", ("w0",))
    links._take(1.0, {"w0 sent": 5})
    links._take(2.0, {"w0 sent": 6, "w1 sent": 1000})  # a counter whose past is not the run's
    links._take(3.0, {"w0 sent": 7, "w1 sent": 1010})
    assert links.timeline()["links"] == {"w0 sent": [0, 1, 2], "w1 sent": [0, 0, 10]}
    cpu = CpuMeter(path=tmp_path / "stat")
    cpu._take(1.0, {"user": 5})
    cpu._take(2.0, {"user": 6, "process rank 0": 30})  # started after the meter: all 30 ticks are the run's
    cpu.cores = 1
    assert cpu.timeline()["processes"] == {"rank 0": [0, 30]}


def test_a_meter_that_cannot_enter_its_namespace_says_which():
    with pytest.raises(OSError, match="psar-no-such-namespace"):
        LinkMeter("psar-no-such-namespace", ("w0",)).start()


def test_bytes_between_two_times_grow_evenly_between_readings():
    times, counts = [0.0, 1.0, 2.0], [0, 100, 100]
    assert carried(times, counts, 0.25, 0.75) == pytest.approx(50)
    assert carried(times, counts, 0.5, 5.0) == pytest.approx(50)
    assert carried(times, counts, -1.0, 0.0) == 0


def _run(tmp_path, step_s=1.0, steps=4, rate_bits=8e6):
    """A run whose worker sends at its link's rate in the first 40% of every step and nothing
    after; its shard receives the same, and sends at half the rate all the time."""
    (tmp_path / "metrics").mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "summary.json").write_text(json.dumps({"engine": "ps-sync", "workers": 1, "servers": 1,
                                                       "network": {"rate_bits": rate_bits, "rate": "8mbit"}}))
    walls = [100.0 + step_s * k for k in range(steps + 1)]
    (tmp_path / "metrics" / "rank0.jsonl").write_text(
        "".join(json.dumps({"step": k, "wall": w, "time": w - 99.5}) + "\n" for k, w in enumerate(walls)))
    rate = rate_bits / 8
    t = [100.0 + i * 0.01 for i in range(int(steps * step_s / 0.01) + 1)]
    sent = [rate * sum(min(0.4 * step_s, max(0.0, x - w)) for w in walls[:-1]) for x in t]
    links = {"w0 sent": sent, "s0 received": sent, "s0 sent": [rate / 2 * (x - 100.0) for x in t]}
    (tmp_path / LINKS_FILE).write_text(json.dumps({"interval_s": 0.01, "t": t, "links": links}))
    return load_run(tmp_path)


def test_each_links_share_of_a_step_and_its_tenths(tmp_path):
    found = busy(_run(tmp_path))
    assert found["steps"] == 4 and found["step_s"] == pytest.approx(1.0)  # steps 1-4, from the end of each before
    assert found["links"]["w0 sent"] == pytest.approx(0.4, abs=1e-6)
    assert found["links"]["s0 sent"] == pytest.approx(0.5, abs=1e-6)
    tenths = found["classes"]["workers sent"]["tenths"]
    assert tenths == pytest.approx([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], abs=1e-6)
    assert found["classes"]["shards sent"]["tenths"] == pytest.approx([0.5] * 10, abs=1e-6)
    assert "workers received" not in found["classes"]
    assert links_busy(_run(tmp_path)) == pytest.approx(0.4, abs=1e-6)  # the table's column: 0.4, 0.4, 0.5
    text = table(_run(tmp_path), "r")
    assert "workers sent (1)" in text and "least busy: w0 sent 40%" in text


def test_a_run_without_a_timeline_says_so_and_a_broken_one_is_named(tmp_path):
    run = _run(tmp_path)
    (tmp_path / LINKS_FILE).write_text(json.dumps({"t": [1.0, 2.0], "links": {"w0 sent": [0]}}))
    with pytest.raises(ValueError, match=LINKS_FILE):
        busy(run)
    (tmp_path / LINKS_FILE).unlink()
    assert busy(run) is None and links_busy(run) is None and "no links' timeline" in table(run, "r")


def test_steps_outside_the_timeline_or_across_a_restart_are_left_out(tmp_path):
    run = _run(tmp_path)
    assert steps(run, (100.0, 102.5)) == [(100.0, 101.0), (101.0, 102.0)]
    records = run.metrics[0]
    records[3]["time"] = 0.2  # step 3 ended in a process started again after step 2
    records[4]["wall"] = records[3]["wall"]  # and step 4 took no time on the clock
    assert steps(run) == [(100.0, 101.0), (101.0, 102.0)]


def test_the_figure_draws_the_runs_with_a_timeline_and_none_without(tmp_path):
    from analysis import plots

    run = _run(tmp_path / "run")
    path = plots.links_through_a_step([run], tmp_path / "figures")
    assert path.name == "links_through_a_step.png" and path.stat().st_size > 10_000
    (tmp_path / "run" / LINKS_FILE).unlink()
    assert plots.links_through_a_step([run], tmp_path / "none") is None
