"""The emulated network's racks as settings: where each worker and shard goes, and what is
refused, naming the key (validation errors get their own tests)."""

from __future__ import annotations

import re

import pytest

from experiments.settings.net import NetConfig
from experiments.settings.overrides import OverrideError
from experiments.settings.presets import build_config

RACKS = ("net.rate=200mbit", "net.racks=2")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("net,workers,expected", [
    (NetConfig(), 3, [0, 0, 0]),
    (NetConfig(rate="1gbit", racks=2), 5, [0, 1, 0, 1, 0]),
    (NetConfig(rate="1gbit", racks=3), 4, [0, 1, 2, 0]),
    (NetConfig(rate="1gbit", racks=2, worker_racks="0,0,1,1"), 4, [0, 0, 1, 1]),
    (NetConfig(rate="1gbit", racks=3, worker_racks=" 2, 0 ,2"), 3, [2, 0, 2]),
])
def test_workers_go_round_robin_or_where_the_list_says(net, workers, expected):
    assert [net.worker_rack(r, workers) for r in range(workers)] == expected


@pytest.mark.timeout(10)
def test_shards_go_round_robin_where_the_list_says_or_with_their_worker():
    separate = NetConfig(rate="1gbit", racks=2, placement="separate")
    assert [separate.server_rack(s, 3) for s in range(3)] == [0, 1, 0]
    listed = NetConfig(rate="1gbit", racks=2, placement="separate", server_racks="1,1,0")
    assert [listed.server_rack(s, 3) for s in range(3)] == [1, 1, 0]
    colocated = NetConfig(rate="1gbit", racks=2, worker_racks="1,0")
    assert [colocated.server_rack(s, 4, workers=2) for s in range(4)] == [1, 0, 1, 0]  # shard s on worker s % 2
    with pytest.raises(ValueError, match="needs the workers"):
        colocated.server_rack(0, 4)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("net,call,message", [
    (NetConfig(rate="1gbit", racks=2, worker_racks="0,1,1"), lambda n: n.worker_rack(0, 4),
     "net.worker_racks='0,1,1' places 3 hosts; the run has 4 workers"),
    (NetConfig(rate="1gbit", racks=2, worker_racks="0,2"), lambda n: n.worker_rack(0, 2),
     "net.worker_racks='0,2': rack 2 is not one of net.racks=2 (0..1)"),
    (NetConfig(rate="1gbit", racks=2, placement="separate", server_racks="1"), lambda n: n.server_rack(0, 2),
     "net.server_racks='1' places 1 hosts; the run has 2 separate shards"),
    (NetConfig(rate="1gbit", racks=2, placement="separate", server_racks="0,5"), lambda n: n.server_rack(1, 2),
     "net.server_racks='0,5': rack 5 is not one of net.racks=2"),
    (NetConfig(rate="1gbit", racks=2), lambda n: n.worker_rack(4, 4), "4 is not one of 4 workers"),
])
def test_a_list_that_does_not_fit_is_refused_naming_its_key(net, call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(net)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("fields,message", [
    (dict(racks=0), "net.racks=0: must be an int >= 1"),
    (dict(rate="1gbit", uplink="fast"), "net.uplink='fast': rate 'fast'"),
    (dict(worker_racks="0,one"), "net.worker_racks='0,one': expected a comma list of rack indices"),
    (dict(server_racks="-1"), "net.server_racks='-1': expected a comma list of rack indices >= 0"),
    (dict(worker_racks="0,,1"), "net.worker_racks='0,,1'"),
    (dict(rate="1gbit", queue_ms=0), "net.queue_ms=0: must be a finite number > 0"),
    (dict(rate="1gbit", queue_ms=float("inf")), "net.queue_ms=inf: must be a finite number > 0"),
    (dict(rate="1gbit", congestion="reno; reboot"), "net.congestion='reno; reboot': expected a TCP congestion"),
    (dict(rate="1gbit", congestion="cubic,,reno"), "net.congestion='cubic,,reno': expected a TCP congestion"),
])
def test_a_setting_that_is_wrong_on_its_own_is_refused_at_once(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        NetConfig(**fields)


@pytest.mark.timeout(30)
def test_racks_are_checked_against_the_run_once_every_override_is_in():
    # net.uplink before net.racks and net.rate after: only the whole decides.
    cfg = build_config("quickstart", ["net.uplink=100mbit", "net.worker_racks=1,0,1", "net.racks=2",
                                      "net.rate=200mbit"], engine="allreduce", workers=3)
    assert (cfg.net.racks, cfg.net.uplink, [cfg.net.worker_rack(r, 3) for r in range(3)]) == (2, "100mbit", [1, 0, 1])
    separate = build_config("quickstart", [*RACKS, "net.placement=separate", "net.server_racks=1,1"],
                            engine="ps-sync", servers=2)
    assert [separate.net.server_rack(s, 2) for s in range(2)] == [1, 1]
    # A non-ps engine runs no shards: the list waits for a run that has them (one grid, many engines).
    build_config("quickstart", [*RACKS, "net.placement=separate", "net.server_racks=1,1,1"], engine="allreduce")
    # Without --net, racks only group the workers (hierarchical all-reduce on a real cluster).
    assert build_config("quickstart", ["net.racks=2"], engine="allreduce", workers=4).net.worker_rack(3, 4) == 1
    for overrides, engine, message in [
        (["net.racks=2", "net.uplink=100mbit"], "allreduce", "net.uplink=100mbit shapes an emulated network: "
                                                             "give --net RATE too"),
        (["net.queue_ms=300"], "ps-sync", "net.queue_ms=300 sizes an emulated switch port's queue: give --net RATE"),
        (["net.congestion=reno"], "ps-sync", "net.congestion=reno sets the emulated hosts' TCP: give --net RATE too"),
        (["net.rate=200mbit", "net.uplink=100mbit"], "allreduce", "net.uplink=100mbit joins racks to the core: "
                                                                  "set net.racks above 1 too"),
        ([*RACKS, "net.worker_racks=0,1,1"], "allreduce", "net.worker_racks='0,1,1' places 3 hosts; the run has 2"),
        ([*RACKS, "net.worker_racks=0,3"], "ps-sync", "rack 3 is not one of net.racks=2"),
        ([*RACKS, "net.server_racks=1"], "ps-sync", "net.server_racks='1': co-located shards are in their workers' "
                                                    "racks; set net.placement=separate"),
        ([*RACKS, "net.placement=separate", "net.server_racks=0,1"], "ps-sync",
         "net.server_racks='0,1' places 2 hosts; the run has 1 separate shards"),
    ]:
        with pytest.raises(OverrideError, match=re.escape(message)):
            build_config("quickstart", overrides, engine=engine)


@pytest.mark.timeout(10)
def test_a_switch_port_queues_queue_ms_of_its_rate_past_its_burst():
    from experiments.runtime.netns import QUEUE_MIN_BYTES, QUEUE_MS, Network

    assert NetConfig().queue_ms == QUEUE_MS  # the setting's default is the network's

    assert Network(("w0",), "100mbit").queue_bytes(3000) == QUEUE_MIN_BYTES  # 10 ms and the burst: 128 KB
    assert Network(("w0",), "1gbit").queue_bytes(3000) == 1_253_000
    deep = Network(("w0",), "100mbit", queue_ms=300.0)
    assert deep.queue_bytes(3000) == 3_750_000 + 3000  # 300 ms of 12.5 MB/s, past the burst
    assert Network(("w0",), "1gbit", queue_ms=300.0).queue_bytes(3000, "100mbit") == 3_753_000


@pytest.mark.timeout(10)
def test_a_link_bursts_what_the_collectives_model_prices_and_never_below_a_few_mtus():
    from allreduce.auto import EMULATED_BURST_MIN_BYTES, EMULATED_BURST_S
    from allreduce.plancost import Links
    from experiments.runtime.netns import BURST_MIN_BYTES, BURST_S, burst_bytes

    # the model prices the burst the links hold
    assert (BURST_S, BURST_MIN_BYTES) == (EMULATED_BURST_S, EMULATED_BURST_MIN_BYTES)
    links = Links(1.0, burst_s=BURST_S, burst_min=BURST_MIN_BYTES)
    for bits in (100e6, 200e6, 576e6, 1e9, 2e9, 20e9):
        assert links.burst(bits / 8) == burst_bytes(bits)
    assert burst_bytes(2e9) == 250_000  # 1 ms of 2gbit
    assert burst_bytes(100e6) == 16_000  # 1 ms of 100mbit is 12.5 KB: a few frames at least
    assert Links(1.0).burst(125e6) == 0.0  # a real link: none


@pytest.mark.timeout(10)
def test_hosts_build_no_packet_larger_than_the_burst_of_a_link_it_may_cross():
    from experiments.runtime.netns import GSO_MAX_BYTES, Network, burst_bytes, gso_bytes

    for bits in (100e6, 200e6, 500e6, 1e9, 20e9):
        assert gso_bytes(bits) <= min(GSO_MAX_BYTES, 0.9 * burst_bytes(bits))
    assert gso_bytes(1e9) == GSO_MAX_BYTES  # 125 KB of burst: the kernel's own packets fit
    assert Network(("w0",), "200mbit").gso_bytes() == 22_500
    # the uplinks' burst (500mbit: 62.5 KB) is the smaller one here
    assert Network(("w0", "w1"), "1gbit", racks=(0, 1), uplink="500mbit").gso_bytes() == 56_250
    assert Network(("w0",), "").gso_bytes() == GSO_MAX_BYTES  # unshaped: the kernel's default


@pytest.mark.timeout(30)
def test_a_run_without_a_network_takes_the_default_tcp_or_none_as_runs_recorded_it_before():
    """net.congestion shapes only an emulated network: without --net the default, and the ""
    that runs recorded before the default was a list, both pass (a run resumes); another not."""
    assert build_config("quickstart", [], engine="allreduce").net.congestion == "cubic,reno"
    build_config("quickstart", ["net.congestion="], engine="allreduce")
    with pytest.raises(ValueError, match="net.congestion=bbr sets the emulated hosts' TCP"):
        build_config("quickstart", ["net.congestion=bbr"], engine="allreduce")
