"""The legs of a push+pull (experiments/bench/legs.py): the worker's and the shard's marks line
up into legs that add up to the whole, and a real shard's marks make a table."""

from __future__ import annotations

import pytest

from experiments.bench.legs import format_legs_table, legs_rows, push_pull_legs


def marks_of(pairs):
    return [m for r, s in pairs for m in (["r", r], ["s", s, 0])]


def test_the_marks_line_up_into_legs_per_size():
    # two sizes, two pairs each, the first of each a warm-up; ns on one clock
    times = [(0, 100, 110, 400), (1000, 1100, 1120, 1500),
             (2000, 2200, 2230, 2900), (3000, 3300, 3340, 4100)]
    echo = [(40, 50), (1030, 1045), (2080, 2090), (3100, 3120)]
    ps = [(150, 300), (1200, 1350), (2400, 2600), (3500, 3800)]
    ps_marks = marks_of(ps)
    ps_marks[-1][2] = 1  # the last update moved its key first: the reply before still pointed at it
    for send, cpu in zip(ps_marks[1::2], (5000, 9000, 20000, 90000)):  # the shard's thread's CPU ns so far
        send.append(cpu)
    marks = {"echo": marks_of(echo), "ps": [["s", -5, 0], *ps_marks]}  # the join's reply comes first
    small, large = legs_rows(times, marks, (1024, 1 << 20), warmup=1)
    assert small["pairs"] == 1 and small["bytes"] == 1024
    assert (small["moved"], large["moved"]) == (0.0, 1.0)
    # the second pair of the first size: echo 1000 -> 1030 -> 1045 -> 1100; ps 1100 -> 1200 -> 1350 -> 1500
    assert (small["zmq_to_us"], small["zmq_server_us"], small["zmq_back_us"], small["zmq_total_us"]) == (0.03, 0.015, 0.055, 0.1)
    assert (small["ps_to_us"], small["ps_server_us"], small["ps_back_us"], small["ps_total_us"]) == (0.1, 0.15, 0.15, 0.4)
    assert small["push_call_us"] == 0.02
    # its thread's CPU from one send to the next, within a size: 9000 - 5000 ns, 90000 - 20000
    assert (small["ps_thread_us"], large["ps_thread_us"]) == (4.0, 70.0)
    assert large["ps_server_us"] == 0.3 and large["ps_to_us"] + large["ps_server_us"] + large["ps_back_us"] == \
        pytest.approx(large["ps_total_us"])
    assert "1 MiB" in format_legs_table([small, large])


def test_marks_that_do_not_match_the_workers_are_refused():
    times = [(0, 100, 110, 400)]
    with pytest.raises(ValueError, match="1 pairs timed by the worker, 1 echoes and 0 push"):
        legs_rows(times, {"echo": marks_of([(40, 50)]), "ps": []}, (1024,), warmup=0)
    with pytest.raises(ValueError, match="do not alternate"):
        legs_rows(times, {"echo": [["r", 1], ["r", 2]], "ps": marks_of([(150, 300)])}, (1024,), warmup=0)


@pytest.mark.timeout(90)
def test_a_shard_and_a_worker_time_their_legs(tmp_path):
    [row] = push_pull_legs(tmp_path, sizes=(1024,), iters=20, warmup=5)
    assert row["pairs"] == 20
    for side in ("zmq", "ps"):
        legs = [row[f"{side}_{k}_us"] for k in ("to", "server", "back")]
        assert all(x > 0 for x in legs) and row[f"{side}_total_us"] >= max(legs)
    assert row["ps_server_us"] > row["zmq_server_us"]  # decoding, updating and answering, against handing back
    assert row["ps_thread_us"] > 0  # the shard's thread's CPU on each push+pull
