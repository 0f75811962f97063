"""Engines' exchanges played over the fair-share links (analysis/schedules.py): on a flat
network they take the closed forms' time (analysis/linkmodel.py, payload aside), with
latency once per hop or phase, and on racks the uplink binds."""

from __future__ import annotations

import time

import pytest

from analysis.linkmodel import PAYLOAD, link_time, psar_link_time
from analysis.schedules import Cluster, gossip, parameter_server, parameter_server_pipelined, ring_allreduce

RATE = 25e6  # bytes/s: 200mbit
M = 4e6


def ideal(label: str, workers: int, servers: int, placement: str = "colocated") -> float:
    """linkmodel's closed form at RATE bytes/s of payload (a parameter server's: psar's phased
    exchange, a push phase then a pull phase)."""
    closed = psar_link_time if label.startswith("ps-") else link_time
    return closed(label, workers, servers, M, RATE * 8 / PAYLOAD, placement)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_on_a_flat_network_the_ring_and_the_shards_take_the_closed_forms_time(n):
    flat = Cluster(n, RATE)
    assert ring_allreduce(flat, M) == pytest.approx(ideal("allreduce/library", n, 1))
    assert parameter_server(flat, M, n) == pytest.approx(ideal("ps-async", n, n))  # co-located: the ring's bytes
    separate = Cluster(n, RATE, servers=2)
    assert parameter_server(separate, M, 2) == pytest.approx(ideal("ps-async", n, 2, "separate"))


def test_latency_is_paid_once_per_hop_and_per_phase():
    n, latency = 4, 0.005
    assert ring_allreduce(Cluster(n, RATE, latency=latency), M) == pytest.approx(
        ring_allreduce(Cluster(n, RATE), M) + 2 * (n - 1) * latency)
    assert parameter_server(Cluster(n, RATE, servers=1, latency=latency), M, 1) == pytest.approx(
        parameter_server(Cluster(n, RATE, servers=1), M, 1) + 2 * latency)


def test_on_racks_the_uplink_binds_the_ring_where_it_crosses():
    """Workers alternate between 2 racks (rank % 2), so every hop of the ring crosses: each
    rack's 4 hosts send M/8 up at once through an uplink a quarter of their links' sum (4:1)."""
    n = 8
    racks = Cluster(n, RATE, racks=2, uplink=RATE)
    hop = 4 * (M / n) / RATE
    assert ring_allreduce(racks, M) == pytest.approx(2 * (n - 1) * hop)
    assert ring_allreduce(racks, M) == pytest.approx(4 * ring_allreduce(Cluster(n, RATE), M))
    assert ring_allreduce(Cluster(n, RATE, racks=2), M) == pytest.approx(ring_allreduce(Cluster(n, RATE), M))


def test_a_1024_worker_ring_and_parameter_server():
    big = Cluster(1024, 50e9 / 8)
    assert ring_allreduce(big, 400e6) == pytest.approx(2 * 1023 / 1024 * 400e6 / (50e9 / 8))
    assert parameter_server(Cluster(64, 50e9 / 8, servers=8), 400e6, 8) == pytest.approx(2 * 64 * 400e6 / 8 / (50e9 / 8))


def test_a_cluster_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="shard hosts"):
        parameter_server(Cluster(4, RATE, servers=2), M, 4)
    with pytest.raises(ValueError, match="rate > 0"):
        Cluster(4, 0)


def test_gossip_sends_each_out_neighbour_the_model_at_once():
    one = M / RATE
    assert gossip(Cluster(8, RATE), M, "ring") == pytest.approx(2 * one)
    assert gossip(Cluster(8, RATE), M, "one-peer-exponential") == pytest.approx(one)
    # two racks (rank % 2) behind one host's rate: offset 1 crosses with all 4 of a rack's
    # hosts, offsets 2 and 4 stay inside: (4 + 1 + 1) / 3 on average
    racks = Cluster(8, RATE, racks=2, uplink=RATE)
    assert gossip(racks, M, "one-peer-exponential") == pytest.approx((4 + 1 + 1) / 3 * one)


@pytest.mark.parametrize("workers,servers,shards,racks,uplink,fabric", [
    (4, 4, 4, 1, None, None), (4, 0, 4, 1, None, None), (6, 2, 2, 1, None, None), (6, 0, 6, 1, None, None),
    (4, 0, 2, 1, None, None), (8, 4, 4, 2, 1e6, None), (8, 0, 8, 2, 5e5, None), (1, 1, 1, 1, None, None),
    (4, 4, 4, 1, None, 2.5e6), (6, 2, 2, 1, None, 1.5e6), (8, 0, 8, 2, 1e6, 3e6)])
def test_the_pipelined_exchange_in_one_key_per_shard_is_the_phased_one(workers, servers, shards, racks, uplink,
                                                                      fabric):
    """With one key a shard's answer waits for its whole push: the two phases, however the
    hosts are grouped into classes of flows (checked against every host's own flows), a
    fabric counting every flow of a class."""
    cluster = Cluster(workers, 1e6, servers, racks, uplink, latency=0.003, fabric=fabric)
    phased = parameter_server(cluster, 4e6, shards)
    assert parameter_server_pipelined(cluster, 4e6, shards, key_bytes=1e9) == pytest.approx(phased, rel=1e-9)


def test_a_fabric_slower_than_the_links_together_shares_itself_among_every_flow():
    """4 hosts whose links would move 4 RATE at once, on a fabric of 2 RATE: every hop of the
    ring takes twice as long; one of 4 RATE or more changes nothing. 4 workers pushing to 4
    shards of their own and pulling back, pipelined in keys, move 2 N M through it: no sooner
    than 2 N M over the fabric, and (every link busy at its share) not much later."""
    assert ring_allreduce(Cluster(4, RATE, fabric=2 * RATE), M) == pytest.approx(2 * ring_allreduce(Cluster(4, RATE), M))
    assert ring_allreduce(Cluster(4, RATE, fabric=4 * RATE), M) == pytest.approx(ring_allreduce(Cluster(4, RATE), M))
    fabric = 1.5 * RATE
    played = parameter_server_pipelined(Cluster(4, RATE, 4, fabric=fabric), M, 4, key_bytes=M / 64)
    assert 2 * 4 * M / fabric <= played < 1.05 * 2 * 4 * M / fabric
    with pytest.raises(ValueError, match="fabric"):
        Cluster(4, RATE, fabric=0)


def test_keys_let_a_shards_answers_overlap_the_pushes_still_coming():
    """4 workers, 4 shards of their own, M = 4 MB at 1 MB/s, k keys per shard: pushes take M/B
    and the last key's answer M/(kB) more."""
    cluster = Cluster(4, 1e6, 4)
    for keys in (1, 2, 8):
        assert parameter_server_pipelined(cluster, 4e6, 4, key_bytes=1e6 / keys) == pytest.approx(4.0 * (1 + 1 / keys))


def test_the_pipelined_exchange_of_1024_workers_is_played_in_well_under_a_second():
    start = time.perf_counter()
    seconds = parameter_server_pipelined(Cluster(1024, 1.25e9, 0, 4, 1e9), 1e8, 1024, key_bytes=4 << 20)
    assert seconds > 0 and time.perf_counter() - start < 1.0


def test_a_window_of_one_key_waits_out_each_round_trip():
    """One worker, one shard of its own, 4 keys of 1 MB at 1 MB/s, 0.1 s of latency: with a
    window of one key each key goes and comes back alone (4 x (1 + 0.1) x 2 s); with none the
    pushes stream and only the last key's answer follows them (4 + 0.1 + 1 + 0.1 s), as with a
    window of three keys; with two, the third key waits 0.2 s for the first's answer."""
    cluster = Cluster(1, 1e6, 1, latency=0.1)
    assert parameter_server_pipelined(cluster, 4e6, 1, 1e6, window=1) == pytest.approx(8.8)
    assert parameter_server_pipelined(cluster, 4e6, 1, 1e6) == pytest.approx(5.2)
    assert parameter_server_pipelined(cluster, 4e6, 1, 1e6, window=3) == pytest.approx(5.2)
    assert parameter_server_pipelined(cluster, 4e6, 1, 1e6, window=2) == pytest.approx(5.4)


FAST = 1e15  # bytes/s: links so fast that only a shard's own time is left


def test_a_shard_takes_its_workers_pushes_one_at_a_time():
    """On links that take no time, a shard's exchange is its own time on the pushes it takes,
    one after the other (Cluster.shard_message a message, shard_byte a byte): 16 workers' k
    keys each to one shard take 16 k of a key's; 4 shards take theirs at once; phased, a
    shard takes its pushes between its two phases, and one on a worker's host takes only the
    others' (co-located: 3 of 4)."""
    message, byte = 1e-4, 1e-9
    cluster = Cluster(16, FAST, 1, shard_message=message, shard_byte=byte)
    for keys in (1, 4):
        key = M / keys
        assert parameter_server_pipelined(cluster, M, 1, key) == pytest.approx(16 * keys * (message + byte * key), 1e-4)
    four = Cluster(16, FAST, 4, shard_message=message, shard_byte=byte)
    assert parameter_server_pipelined(four, M, 4, M / 4) == pytest.approx(16 * (message + byte * M / 4), 1e-4)
    assert parameter_server(four, M, 4) == pytest.approx(16 * (message + byte * M / 4), 1e-4)
    colocated = Cluster(4, FAST, shard_message=message)
    assert parameter_server(colocated, M, 4) == pytest.approx(3 * message, 1e-4)
    assert parameter_server_pipelined(colocated, M, 4, M / 4) == pytest.approx(3 * message, 1e-4)


def test_a_shards_own_time_overlaps_the_links_and_adds_little_where_they_are_slow():
    """At 200mbit, 4 workers and 4 shards, M = 4 MB in 16 keys a shard: the default time of
    a shard (psar bench's on this project's machine) adds under 1% to the pipelined exchange,
    and less than all of it (a shard takes a key while the next ones come in)."""
    from analysis.predict import SHARD_BYTE_S, SHARD_MESSAGE_S

    plain = Cluster(4, RATE, 4)
    costed = Cluster(4, RATE, 4, shard_message=SHARD_MESSAGE_S, shard_byte=SHARD_BYTE_S)
    key = M / 4 / 16
    without, with_shard = (parameter_server_pipelined(c, M, 4, key) for c in (plain, costed))
    after = 4 * 16 * (SHARD_MESSAGE_S + SHARD_BYTE_S * key)  # a shard's time on every push it takes
    assert without < with_shard < min(without + after, 1.01 * without)


def test_a_shards_time_cannot_be_negative():
    with pytest.raises(ValueError, match="shard"):
        Cluster(4, RATE, shard_message=-1e-6)
    with pytest.raises(ValueError, match="shard"):
        Cluster(4, RATE, shard_byte=-1e-12)
