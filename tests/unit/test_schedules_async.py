"""The parameter server's exchange under async (analysis/schedules_async.py): one worker
played against the others' load on average, its messages leaving a few at a time in the
order it sends them; and psar predict's pace of an async step (analysis/predict.drifting)."""

from __future__ import annotations

import pytest

from analysis.predict import Target, _own_target, drifting, exchange, predict
from analysis.schedules import Cluster, parameter_server_pipelined
from analysis.schedules_async import parameter_server_async
from test_labels import M, RATE_BITS, fake_run

RATE = 25e6
LONG = 1e9  # a step so long that the others' load is nothing


def test_alone_its_keys_leave_one_after_the_other_and_each_is_answered_at_once():
    """Two shards, one key each, no load from the other worker: the first key is answered
    while the second leaves, the second's answer comes last: 1.5 M/B, where lockstep plays
    every push and then every answer (2 M/B)."""
    cluster = Cluster(2, RATE, 2)
    assert parameter_server_async(cluster, M, 2, key_bytes=M, period=LONG) == pytest.approx(1.5 * M / RATE)
    assert parameter_server_pipelined(cluster, M, 2, key_bytes=M) == pytest.approx(2 * M / RATE)
    # eight keys a shard: the last answer is 1/16 of the bytes
    assert parameter_server_async(cluster, M, 2, key_bytes=M / 16, period=LONG) == pytest.approx(
        (1 + 1 / 16) * M / RATE)


def test_the_others_load_leaves_it_less_of_each_shard_link_and_it_sends_more_at_once():
    """At a pace where the other worker fills half of each shard's link (M/2 a step of M/B),
    each push has half a link: two leave at once and fill its own, and their answers come
    together: 2 M/B. A slower pace leaves more; none is slower than that."""
    cluster = Cluster(2, RATE, 2)
    busy = parameter_server_async(cluster, M, 2, key_bytes=M, period=M / RATE)
    assert busy == pytest.approx(2 * M / RATE)
    paced = [parameter_server_async(cluster, M, 2, key_bytes=M, period=p * M / RATE) for p in (1, 2, 4, 1e6)]
    assert paced == sorted(paced, reverse=True) and paced[-1] == pytest.approx(1.5 * M / RATE)
    # however short the pace, a link leaves it no less than its share of the bytes
    assert parameter_server_async(cluster, M, 2, key_bytes=M, period=1e-9) == pytest.approx(busy)


def test_many_shards_answer_while_later_keys_leave():
    """16 workers, 16 shards of their own, a key each: in lockstep 2 M/B; drifting apart, at
    the pace their own exchange sets, between M/B and 1.5 M/B (runs measured 1.2 to 1.45 M/B,
    docs/cost-model.md), and the more shards, the closer to M/B."""
    paces = {}
    for n in (2, 16, 64):
        cluster = Cluster(n, RATE, n)
        assert parameter_server_pipelined(cluster, M, n, key_bytes=M / n) == pytest.approx(2 * M / RATE)
        paces[n] = drifting(0.0, 2 * M / RATE, lambda p: parameter_server_async(cluster, M, n, M / n, p)) / (M / RATE)
    assert 1 < paces[64] < paces[16] < 1.5 < paces[2] <= 2


def test_racks_and_fabric_carry_the_others_load_too():
    """Behind uplinks as fast as the hosts' links, or through a fabric, a worker's exchange
    is no shorter than on a flat network, and a slower uplink makes it longer."""
    flat = parameter_server_async(Cluster(4, RATE, 4), M, 4, M / 4, period=2 * M / RATE)
    racks = [parameter_server_async(Cluster(4, RATE, 4, racks=2, uplink=u), M, 4, M / 4, period=2 * M / RATE)
             for u in (2 * RATE, RATE / 2)]
    fabric = parameter_server_async(Cluster(4, RATE, 4, fabric=2 * RATE), M, 4, M / 4, period=2 * M / RATE)
    assert flat <= racks[0] + 1e-12 < racks[1] and flat < fabric
    with pytest.raises(ValueError, match="period"):
        parameter_server_async(Cluster(4, RATE, 4), M, 4, M / 4, period=0.0)


def test_drifting_finds_the_pace_at_which_the_exchange_is_played():
    """p = compute + comm(p) for an exchange that shrinks as the pace slows."""
    def comm_at(p):
        return 0.02 + 0.001 / p

    comm = drifting(0.01, 0.5, comm_at)
    assert 0.01 + comm == pytest.approx(0.01 + comm_at(0.01 + comm), rel=2e-3)
    assert drifting(0.01, 0.001, comm_at) == pytest.approx(comm, rel=2e-3)  # a lockstep guess too short


def test_predict_plays_ps_async_at_its_own_pace_and_ps_sync_in_lockstep(tmp_path):
    """From a 2-worker ps-async run, 16 workers on 16 shards of their own: shorter than the
    same run played in lockstep, and the step is its compute and the exchange at that step's
    own pace."""
    run = fake_run(tmp_path / "async", "ps-async", workers=2, compute_s=0.01, step_s=0.01 + 1.5 * M / (RATE_BITS / 8))
    target = Target(16, RATE_BITS / 8, servers=16, placement="separate")
    [row] = predict([run], ["ps-async"], [target])
    [lockstep] = predict([fake_run(tmp_path / "sync", "ps-sync", workers=2, compute_s=0.01,
                                   step_s=0.01 + 1.5 * M / (RATE_BITS / 8))], ["ps-sync"], [target])
    assert row["step_s"] < lockstep["step_s"]
    # the calibration: the run's measured exchange over the one played at its own pace
    step = 0.01 + 1.5 * M / (RATE_BITS / 8)
    ratio = (step - 0.01) / exchange("ps-async", _own_target(run), M, period=step)
    assert row["compute_s"] == pytest.approx(0.01)
    assert row["comm_s"] == pytest.approx(ratio * exchange("ps-async", target, M, period=row["step_s"]), rel=1e-2)
    assert row["comm_s"] < ratio * exchange("ps-async", target, M)  # in lockstep


def test_ps_ssp_is_played_in_lockstep(tmp_path):
    """ssp's bound holds its workers together (docs/cost-model.md): from a 2-worker ps-ssp
    run, 16 workers are its calibration's ratio times the lockstep schedule."""
    step = 0.01 + 1.5 * M / (RATE_BITS / 8)
    run = fake_run(tmp_path / "ssp", "ps-ssp", workers=2, compute_s=0.01, step_s=step)
    target = Target(16, RATE_BITS / 8, servers=16, placement="separate")
    [row] = predict([run], ["ps-ssp"], [target])
    ratio = (step - 0.01) / exchange("ps-ssp", _own_target(run), M)
    assert row["comm_s"] == pytest.approx(ratio * exchange("ps-ssp", target, M))


def test_a_shards_own_time_answers_a_push_once_it_has_taken_it():
    """Links that take no time, one key to one shard taking 1e-4 s a message: alone, its answer
    comes 1e-4 s after its push; at a pace where the other worker's messages take half of the
    shard's thread, 2e-4 s; and never sooner than its own share of that thread."""
    message = 1e-4
    cluster = Cluster(2, 1e15, 1, shard_message=message)
    assert parameter_server_async(cluster, M, 1, key_bytes=M, period=LONG) == pytest.approx(message, rel=1e-3)
    assert parameter_server_async(cluster, M, 1, key_bytes=M, period=2 * message) == pytest.approx(2 * message, rel=1e-3)
    assert parameter_server_async(cluster, M, 1, key_bytes=M, period=1e-9) == pytest.approx(2 * message, rel=1e-3)
