"""Emulated hosts: shaped links carry their rate each way at once, and nothing is left behind,
even by a run that was killed. Needs root and iproute2; skipped elsewhere, with the reason."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from experiments.runtime import netns as network
from experiments.runtime.netns import Network
from experiments.settings.net import parse_rate

REASON = network.unavailable()
F64 = ("dtype=float64", "threads=1")
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated hosts unavailable: {REASON}")

# Receive for SECONDS on the host's address; meanwhile send to the peer as fast as it takes.
BLAST = """
import socket, sys, threading, time
me, peer, port, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
server = socket.create_server((me, port))
got = []
def receive():
    conn, _ = server.accept()
    start, n = None, 0
    while True:
        data = conn.recv(1 << 16)
        if not data:
            break
        if start is None:
            start = time.monotonic()
        n += len(data)
        last = time.monotonic()
    got.append(n * 8 / (last - start))
t = threading.Thread(target=receive); t.start()
for _ in range(100):
    try:
        out = socket.create_connection((peer, port), timeout=5); break
    except OSError:
        time.sleep(0.05)
chunk = b"x" * (1 << 16)
end = time.monotonic() + seconds
while time.monotonic() < end:
    out.sendall(chunk)
out.close(); t.join(30)
print(got[0])
"""


def start_blasts(pairs, port: int, seconds: float) -> list[subprocess.Popen]:
    """BLAST on every (host, peer) pair at once: host receives on its address and sends to peer."""
    return [subprocess.Popen(h.argv(sys.executable, "-c", BLAST, h.addr, peer.addr, port, seconds),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for h, peer in pairs]


def blast_rates(procs: list[subprocess.Popen]) -> list[float]:
    """The bits per second each BLAST received, in order; a BLAST that failed fails the test
    (and none outlives it)."""
    rates = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            rates.append(float(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return rates


@pytest.mark.parametrize("rate,bits", [("200mbit", 200e6), ("1gbit", 1e9), ("10mbps", 80e6), ("1.5kbit", 1500)])
def test_parse_rate(rate, bits):
    assert parse_rate(rate) == bits


@pytest.mark.parametrize("rate", ["", "fast", "200", "-1mbit", "200 mb"])
def test_parse_rate_refuses(rate):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(rate)


def test_a_queue_holds_10_ms_of_the_rate_but_never_a_handful_of_packets():
    # tbf's limit: 10 ms of the rate past the burst (what `latency 10ms` gave), 150 KB at least.
    assert network.Network(("a",), rate="200mbit").queue_bytes(100_000) == 350_000
    assert network.Network(("a",), rate="20mbit").queue_bytes(16_000) == network.QUEUE_MIN_BYTES


@needs_netns
@pytest.mark.timeout(120)
def test_each_way_runs_at_the_rate_at_once():
    """Full duplex: a and b send to each other at the same time, and each receives at RATE."""
    with Network(("a", "b"), rate="200mbit") as net:
        a, b = net.hosts["a"], net.hosts["b"]
        rates = blast_rates(start_blasts(((a, b), (b, a)), 6000, 2.0))
        counters = a.counters()
    print(f"200mbit link, both ways at once: {rates[0] / 1e6:.1f} and {rates[1] / 1e6:.1f} Mbit/s")
    for measured in rates:
        assert abs(measured / 200e6 - 1) < 0.15, f"{measured / 1e6:.0f} Mbit/s on a 200mbit link"
    assert counters["tx_bytes"] > 0.8 * 2.0 * 200e6 / 8 and counters["rx_bytes"] > 0.8 * 2.0 * 200e6 / 8


# Send to every peer given at once, one flow each, for SECONDS; a peer counts what it gets.
FAN_OUT = """
import socket, sys, threading, time
me, port, seconds, peers = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
chunk = b"x" * (1 << 16)
def send(peer):
    for _ in range(100):
        try:
            out = socket.create_connection((peer, port), timeout=5); break
        except OSError:
            time.sleep(0.05)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        out.sendall(chunk)
    out.close()
threads = [threading.Thread(target=send, args=(p,)) for p in peers]
for t in threads: t.start()
for t in threads: t.join(60)
"""
SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
conn, _ = server.accept()
n, start = 0, None
while True:
    data = conn.recv(1 << 16)
    if not data:
        break
    start = start or time.monotonic()
    n += len(data)
    last = time.monotonic()
print(n * 8 / (last - start))
"""


@needs_netns
@pytest.mark.timeout(120)
def test_a_host_shares_its_link_equally_among_its_peers_and_drops_none_of_its_own():
    """A NIC under fair queueing: a host sending to two peers at once gives each half of its
    rate, and its own queue never drops what its flows hand it."""
    with Network(("a", "b", "c"), rate="200mbit") as net:
        a, b, c = (net.hosts[n] for n in "abc")
        sinks = [subprocess.Popen(h.argv(sys.executable, "-c", SINK, h.addr, 6001), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for h in (b, c)]
        time.sleep(0.5)
        source = subprocess.run(a.argv(sys.executable, "-c", FAN_OUT, a.addr, 6001, 3.0, b.addr, c.addr),
                                capture_output=True, text=True, timeout=60)
        assert source.returncode == 0, source.stderr
        rates = []
        for p in sinks:
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, err
            rates.append(float(out) / 1e6)
        drops = network.run("tc", "-n", a.netns, "-s", "qdisc", "show", "dev", network.IFNAME).stdout
    print(f"one host to two peers on 200mbit: {rates[0]:.1f} and {rates[1]:.1f} Mbit/s")
    assert all(70 < r < 120 for r in rates), rates
    assert sum(rates) > 170, rates
    assert "dropped 0," in drops and not re.search(r"dropped [1-9]", drops), drops


@needs_netns
@pytest.mark.timeout(120)
def test_nothing_is_left_and_a_killed_runs_leftovers_are_cleaned():
    with Network(("a", "b"), rate="100mbit") as net:
        names = [h.netns for h in net.hosts.values()] + [net.bridge_ns]
        assert set(names) <= set(network._namespaces())
    assert not set(names) & set(network._namespaces())
    # A run killed with SIGKILL cannot clean up; the next one removes what it left.
    code = ("from experiments.runtime.netns import Network\nimport time,sys\n"
            "n = Network(('x',), rate='10mbit').up()\nprint(n.prefix, flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    prefix = proc.stdout.readline().strip()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    left = [n for n in network._namespaces() if n.startswith(prefix)]
    assert len(left) == 2, left
    removed = network.clean_stale()
    assert set(left) <= set(removed)
    assert not [n for n in network._namespaces() if n.startswith(prefix)]


@needs_netns
@pytest.mark.timeout(60)
def test_sigterm_removes_the_network():
    code = ("from experiments.runtime.netns import Network\nimport time\n"
            "with Network(('x', 'y'), rate='10mbit') as n:\n"
            "    print(n.prefix, flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    prefix = proc.stdout.readline().strip()
    assert [n for n in network._namespaces() if n.startswith(prefix)]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    time.sleep(0.2)
    assert not [n for n in network._namespaces() if n.startswith(prefix)]


def POOL_JOBS() -> dict[str, dict]:
    return {"local": dict(experiment="quickstart", engine="local", steps=6, overrides=F64)}


@needs_netns
@pytest.mark.timeout(60)
def test_a_congestion_control_the_machine_does_not_allow_is_refused_naming_those_it_does():
    with pytest.raises(network.NetworkError, match="net.congestion=nosuchcc: a host's namespace takes only what "
                                                   "this machine allows"):
        Network(("w0",), "100mbit", congestion="nosuchcc").up()
    with Network(("w0", "w1"), "100mbit", congestion="reno") as net:
        assert net.describe()["congestion"] == "reno"
        assert all(network.congestion(h.netns) == "reno" for h in net.hosts.values())
    # Several names: the first the machine allows, on every host.
    with Network(("w0", "w1"), "100mbit", congestion="nosuchcc,reno,bbr") as net:
        assert net.describe()["congestion"] == "reno"
        assert all(network.congestion(h.netns) == "reno" for h in net.hosts.values())
    with pytest.raises(network.NetworkError, match="net.congestion=nosuchcc,othercc: a host's namespace takes only"):
        Network(("w0",), "100mbit", congestion="nosuchcc,othercc").up()
    assert not [n for n in network._namespaces() if n.startswith(f"{network.PREFIX}{os.getpid()}-")]


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_shaped_runs_compute_what_loopback_computes(tmp_path, pool):
    """ps-sync with its shard on a host of its own, and all-reduce, each on hosts joined by
    shaped links, end with the parameters of the local reference (float64, 1e-10)."""
    from conftest import max_param_diff, run_job

    reference = pool.results(__name__)["local"][1]
    for engine, extra in (("ps-sync", ("net.placement=separate", "net.queue_ms=40", "net.congestion=reno")),
                          ("allreduce", ())):
        summary, state = run_job(tmp_path, "quickstart", engine, steps=6,
                                 overrides=F64 + ("net.rate=1gbit", *extra))
        assert max_param_diff(state, reference) <= 1e-10, engine
        hosts = summary["network"]["hosts"]
        assert summary["network"]["queue_ms"] == (40 if engine == "ps-sync" else network.QUEUE_MS)
        # What the hosts' TCP ran: the one asked for, else a loss-based one (cubic where allowed).
        assert summary["network"]["congestion"] in (("reno",) if engine == "ps-sync" else ("cubic", "reno"))
        assert set(hosts) == ({"w0", "w1", "s0"} if engine == "ps-sync" else {"w0", "w1"})
        assert all(h["tx_bytes"] > 0 and h["rx_bytes"] > 0 for h in hosts.values())
        # Each host's TCP counters are its own namespace's, from zero: at most what its link sent.
        assert all(0 < h["tcp"]["segments_out"] < h["tx_bytes"] / 40 for h in hosts.values()), hosts
        assert 0 <= summary["network"]["retransmitted"] < 1 and summary["network"]["timeouts"] >= 0
    assert not [n for n in network._namespaces() if n.startswith(f"{network.PREFIX}{os.getpid()}-")]


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_failed_shaped_run_leaves_no_host_behind(tmp_path):
    from experiments.runtime.launcher import LaunchError, launch
    from experiments.settings.presets import build_config

    cfg = build_config("quickstart", ["net.rate=100mbit", "batch_size=100000"], engine="allreduce", steps=2)
    with pytest.raises(LaunchError, match="rank [01]"):
        launch(cfg, tmp_path / "run", deadline_s=100, quiet=True)
    assert not [n for n in network._namespaces() if n.startswith(f"{network.PREFIX}{os.getpid()}-")]


@needs_netns
@pytest.mark.timeout(120)
def test_the_predict_grids_fabric_probe_measures_what_the_links_carry_at_once():
    """The probe of what a machine's emulated links carry at once (experiments/bench/fabric.py,
    psar bench's and psar compare predict's): all the bytes its hosts sent each other over
    the seconds each round took, never more than their links carry."""
    from experiments.bench.fabric import fabric, fastest_rate

    assert fastest_rate() == "2gbit"
    carried = fabric("100mbit", hosts=3, nbytes=300_000, rounds=1)
    assert carried["hosts"] == 3 and len(carried["seconds"]) == 1
    assert carried["bytes_per_s"] == pytest.approx(3 * 2 * 300_000 / carried["seconds"][0])
    print(f"3 hosts on 100mbit move {carried['bytes_per_s'] / 1e6:.1f} MB/s all together")
    # One round of 300 KB a pair is mostly its flows' start: 0.8 to 0.9 of the links, once 0.48.
    assert 0.3 * 3 * 100e6 / 8 < carried["bytes_per_s"] <= 1.02 * 3 * 100e6 / 8


@needs_netns
@pytest.mark.timeout(120)
def test_the_incast_probe_times_each_round_of_several_hosts_sending_into_one_port():
    """psar bench's incast probe (experiments/bench/incast.py): each round's bytes take at
    least the port's own time for them, and the hosts run the congestion control asked for."""
    from experiments.bench.incast import format_incast_table, incast

    row = incast("reno", rate="100mbit", senders=2, nbytes=100_000, rounds=4, gap_s=0.02)
    assert row["congestion"] == "reno" and len(row["seconds"]) == 3  # the first round left out
    assert row["port_s"] == pytest.approx(2 * 100_000 * 8 / 100e6)
    # Never much faster than the port: its burst lends 16 KB, about 1.3 ms at the rate (of the round's 16).
    assert 0.6 <= row["median_x"] <= row["slowest_tenth_x"] < 50
    assert 0 <= row["retransmitted"] < 1 and row["timeouts"] >= 0
    assert "reno" in format_incast_table([row])
