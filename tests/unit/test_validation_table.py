"""psar predict --validate's table: its count of link-bound rows within 15%, and the notes
naming those outside it whose links were mostly idle, whose host's cores were saturated or
that dropped packets their calibration's did not."""

from analysis.validation import table


def _row(error, retx, calibration, link_bound=True, engine="ps-sync"):
    return {"engine": engine, "workers": 4, "servers": 4, "rate_bits": 100e6, "racks": 1, "latency_s": 0.0,
            "measured_s": 2.6, "step_s": 2.6 * (1 + error), "error": error, "link_bound": link_bound,
            "retransmitted": retx, "calibration_retransmitted": calibration}


def test_rows_outside_that_dropped_anew_are_named_with_what_queues_their_drops():
    text = table([_row(-0.25, 0.037, 0.001), _row(-0.26, 0.002, 0.001), _row(-0.05, 0.04, 0.0),
                  _row(0.4, 0.05, 0.0, link_bound=False)])
    lines = text.splitlines()
    assert lines[1].split()[-2:] == ["3.70", "(0.10)"]
    assert "link-bound rows: 1 of 3 within 15%, largest error 26.0%" in text
    assert "1 of them outside 15% sent 1% or more" in text and "net.queue_ms=300" in text


def test_no_note_where_no_row_outside_dropped_anew():
    text = table([_row(-0.25, 0.03, 0.02), _row(0.1, 0.05, 0.0)])
    assert "link-bound rows: 1 of 2 within 15%" in text and "dropped" not in text


def test_the_exchange_alone_is_its_own_column_and_count():
    rows = [{**_row(-0.01, 0.0, 0.0), "exchange_error": 0.35}, {**_row(0.05, 0.0, 0.0), "exchange_error": -0.1},
            _row(0.02, 0.0, 0.0)]  # a row from before the column: "-"
    lines = table(rows).splitlines()
    assert lines[0].split()[-8:-6] == ["error", "exchange"]
    assert lines[1].split()[-7:-5] == ["-1.0%", "35.0%"] and lines[3].split()[-7:-5] == ["2.0%", "-"]
    assert "link-bound rows: 3 of 3 within 15%" in lines[-2]
    assert lines[-1].endswith("1 of 2 within 15%, largest error 35.0%")


def test_held_out_runs_whose_hosts_ran_another_tcp_than_their_calibration_are_said():
    rows = [{**_row(-0.05, 0.0, 0.0), "congestion": "reno", "calibration_congestion": "bbr"},
            {**_row(-0.05, 0.0, 0.0), "congestion": "reno", "calibration_congestion": "reno"},
            {**_row(-0.05, 0.0, 0.0), "congestion": None, "calibration_congestion": "bbr"}]  # not recorded
    text = table(rows)
    assert "1 held-out run(s) ran another TCP than their calibration (reno against bbr)" in text
    assert "another TCP" not in table(rows[1:])


def test_rows_outside_whose_links_were_mostly_idle_are_counted():
    rows = [{**_row(-0.29, 0.0, 0.0), "links_busy": 0.41}, {**_row(-0.19, 0.0, 0.0), "links_busy": 0.58},
            {**_row(-0.05, 0.0, 0.0), "links_busy": 0.2}, _row(-0.3, 0.0, 0.0)]  # the last: no timeline
    text = table(rows)
    assert text.splitlines()[0].split()[-5] == "links" and text.splitlines()[1].split()[-4] == "41%"
    assert text.splitlines()[4].split()[-4] == "-"
    assert "1 of them outside 15% had their busiest links carry less than 50% of a step" in text
    assert "busiest links" not in table(rows[1:3])


def test_rows_outside_whose_hosts_cores_were_saturated_are_counted():
    rows = [{**_row(-0.29, 0.0, 0.0), "links_busy": 0.41, "host_cpu": 0.97},
            {**_row(-0.19, 0.0, 0.0), "links_busy": 0.58, "host_cpu": 0.62},
            {**_row(-0.05, 0.0, 0.0), "host_cpu": 0.99}, _row(-0.3, 0.0, 0.0)]  # the last: no timeline
    text = table(rows)
    assert text.splitlines()[0].split()[-4] == "cpu" and text.splitlines()[1].split()[-3] == "97%"
    assert text.splitlines()[4].split()[-3] == "-"
    assert "1 of them outside 15% ran on a host whose cores were 90% in use or more" in text
    assert "cores were" not in table(rows[1:3])


def test_rows_outside_whose_own_compute_outgrew_their_calibrations_are_counted():
    rows = [{**_row(-0.27, 0.0, 0.0, engine="allreduce"), "servers": None, "compute_s": 0.005,
             "measured_compute_s": 0.010, "host_cores": 2},  # 4 ranks on 2 cores
            {**_row(-0.17, 0.0, 0.0), "compute_s": 0.006, "measured_compute_s": 0.0061},  # the links' miss
            {**_row(-0.30, 0.0, 0.0), "compute_s": 0.0068, "measured_compute_s": 0.0406},
            {**_row(-0.05, 0.0, 0.0), "compute_s": 0.005, "measured_compute_s": 0.02},  # within 15%
            _row(-0.3, 0.0, 0.0)]  # from before the field
    text = table(rows)
    assert "2 of them outside 15% computed 2.0 to 6.0 times as long a step as their calibration" in text
    assert "; 1 of those ran more ranks and shards than the machine has cores" in text
    assert "times as long" not in table(rows[1:2] + rows[3:])
    assert "more ranks" not in table([{**rows[0], "host_cores": 16}])  # 4 ranks on 16 cores: not said
