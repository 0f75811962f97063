"""Racks of emulated hosts: flows between racks share the rack's uplink, flows inside a rack
do not, and a rack network leaves nothing behind. Needs root and iproute2; skipped elsewhere."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from experiments.runtime import netns as network
from experiments.runtime.linkmeter import LINKS_FILE
from experiments.runtime.netns import Network
from test_network import FAN_OUT, SINK, needs_netns, start_blasts

INTERVALS, INTERVAL_S = 4, 0.5
"""Every flow is measured over the same intervals, once all have started (start-up skew
would otherwise let one run alone for a while and count double), and a test takes the
median interval: now and then on 2 busy cores an interval is 10% short."""


def interval_rates(net: Network, receivers, procs: list[subprocess.Popen]) -> list[dict[str, float]]:
    """For each of INTERVALS intervals once procs (flows into receivers, hosts) have all
    started, the bits per second the switch sent each receiver (by name) and each uplink
    direction (upK, downK), from the switch's port counters; then procs are ended."""
    ports = {f"p{net.names.index(h.name)}": h.name for h in receivers}

    def sample() -> tuple[float, dict[str, int]]:
        t = time.monotonic()
        sent = net.switch_bytes()
        return (t + time.monotonic()) / 2, sent

    try:
        deadline, (_, before) = time.monotonic() + 10, sample()
        samples = [sample()]
        while min(samples[0][1][p] - before[p] for p in ports) < 1 << 20:  # every flow under way
            assert time.monotonic() < deadline, "the flows did not start within 10 s"
            time.sleep(0.05)
            samples = [sample()]
        for _ in range(INTERVALS):
            time.sleep(max(0.0, samples[-1][0] + INTERVAL_S - time.monotonic()))
            samples.append(sample())
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, f"a flow ended while measured: {ended[0].communicate()[1][-500:]}"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    return [{ports.get(dev, dev): (b[dev] - a[dev]) * 8 / (tb - ta) for dev in b
             if dev in ports or not dev.startswith("p")} for (ta, a), (tb, b) in zip(samples, samples[1:])]


def median_of(intervals: list[dict[str, float]], *names: str) -> float:
    """The median over the intervals of the sum of names' rates."""
    return statistics.median(sum(r[n] for n in names) for r in intervals)


@needs_netns
@pytest.mark.timeout(40)
def test_an_oversubscribed_uplink_binds_between_racks_and_not_inside_one():
    """Two racks of two 200mbit hosts behind 100mbit uplinks: the two hosts of rack 0 sending
    to one host each in rack 1 share 100mbit; pairs inside a rack get 200mbit each way."""
    names = ("a0", "a1", "b0", "b1")
    seconds = 30  # longer than any start-up skew and the intervals: interval_rates ends them
    with Network(names, rate="200mbit", racks=(0, 0, 1, 1), uplink="100mbit") as net:
        a0, a1, b0, b1 = (net.hosts[n] for n in names)
        sinks = [subprocess.Popen(h.argv(sys.executable, "-c", SINK, h.addr, 6100), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for h in (b0, b1)]
        sources = [subprocess.Popen(h.argv(sys.executable, "-c", FAN_OUT, h.addr, 6100, seconds, peer.addr),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for h, peer in ((a0, b0), (a1, b1))]
        across = interval_rates(net, (b0, b1), sources + sinks)
        pairs = ((a0, a1), (a1, a0), (b0, b1), (b1, b0))
        within = interval_rates(net, (a0, a1, b0, b1), start_blasts(pairs, 6101, seconds))
    totals = {"into rack 1": median_of(across, "b0", "b1"), "up0": median_of(across, "up0"),
              "down1": median_of(across, "down1")}
    alone = {n: median_of(within, n) for n in names}
    print("200mbit hosts, 100mbit uplinks, median of 0.5 s: rack 0 to rack 1 "
          + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in totals.items())
          + f" Mbit/s (b0 {median_of(across, 'b0') / 1e6:.1f}, b1 {median_of(across, 'b1') / 1e6:.1f}); "
          + "inside a rack, both ways at once: " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in alone.items()))
    for what, total in totals.items():
        assert 0.8 < total / 100e6 < 1.1, f"{what}: {total / 1e6:.0f} Mbit/s through a 100mbit uplink"
    for name, measured in alone.items():
        assert 0.8 < measured / 200e6 < 1.1, f"{name} got {measured / 1e6:.0f} Mbit/s inside its rack"
    crossed = max(r[f"{way}{k}"] for r in within for way in ("up", "down") for k in (0, 1))
    assert crossed < 1e6, f"traffic inside racks crossed an uplink: {crossed / 1e6:.1f} Mbit/s"


@needs_netns
@pytest.mark.timeout(40)
def test_hosts_reach_each_other_across_racks_and_nothing_is_left():
    with Network(("a", "b", "c"), rate="10mbit", racks=(0, 1, 2), uplink="5mbit") as net:
        made = [h.netns for h in net.hosts.values()] + [net.bridge_ns]
        assert set(made) <= set(network._namespaces())
        net.check_tcp(6200)
        described = net.describe()
        # every host builds packets that fit the smallest burst on its way (the uplinks' 16 KB)
        for host in net.hosts.values():
            link = json.loads(network.run("ip", "-n", host.netns, "-j", "-d", "link", "show", network.IFNAME).stdout)
            assert link[0]["gso_max_size"] == 14_400
    assert (described["racks"], described["rack_of"], described["uplink"]) == (3, {"a": 0, "b": 1, "c": 2}, "5mbit")
    assert (described["burst_bytes"], described["packet_bytes"]) == (16_000, 14_400)
    assert not [n for n in network._namespaces() if n.startswith(net.prefix)]


@pytest.mark.timeout(10)
def test_a_rack_for_every_host_or_none():
    with pytest.raises(ValueError, match="a rack index >= 0 for each of 2 hosts"):
        Network(("a", "b"), racks=(0,)).up()
    with pytest.raises(ValueError, match="one rack has no uplink"):
        Network(("a", "b"), rate="1gbit", uplink="100mbit").up()


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_run_in_racks_records_them_and_what_each_uplink_carried(tmp_path):
    """ps-sync, both workers in rack 0 and the separate shard in rack 1: every byte the
    workers send crosses rack 0's uplink and comes down rack 1's, as summary.json says."""
    from conftest import run_job

    summary, _ = run_job(tmp_path, "quickstart", "ps-sync", steps=3, name="racks", overrides=(
        "net.rate=1gbit", "net.racks=2", "net.uplink=500mbit", "net.placement=separate",
        "net.worker_racks=0,0", "net.server_racks=1"))
    net = summary["network"]
    assert (net["racks"], net["uplink"], net["rack_of"]) == (2, "500mbit", {"w0": 0, "w1": 0, "s0": 1})
    assert {name: h["rack"] for name, h in net["hosts"].items()} == net["rack_of"]
    sent = net["hosts"]["w0"]["tx_bytes"] + net["hosts"]["w1"]["tx_bytes"]
    up, down = net["uplinks"]["0"]["up_bytes"], net["uplinks"]["1"]["down_bytes"]
    assert sent > 0 and 0.99 < up / sent < 1.05 and 0.99 < down / sent < 1.05, (sent, net["uplinks"])  # + broadcasts
    assert net["uplinks"]["0"]["link_s"] == pytest.approx(max(up, net["uplinks"]["0"]["down_bytes"]) * 8 / 500e6)
    # The links' timeline, read every few ms through the run, ends where the counters ended.
    links = json.loads((tmp_path / "racks" / LINKS_FILE).read_text())
    assert len(links["t"]) > 10 and links["t"] == sorted(links["t"])
    for name, host in net["hosts"].items():
        for way, key in (("sent", "tx_bytes"), ("received", "rx_bytes")):
            series = links["links"][f"{name} {way}"]
            assert series == sorted(series) and 0.97 * host[key] < series[-1] <= host[key], (name, way)
    assert 0.97 * up < links["links"]["up:r0"][-1] <= up and 0.97 * down < links["links"]["down:r1"][-1] <= down
    assert not [n for n in network._namespaces() if n.startswith(f"{network.PREFIX}{os.getpid()}-")]
