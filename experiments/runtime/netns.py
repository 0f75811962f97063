"""An emulated cluster on one Linux machine: one network namespace per host, each joined to a
bridge by a veth whose two ends are shaped with tc, so that a host sends at RATE and receives
at RATE, as a full-duplex NIC does. With racks, each rack's hosts are on a bridge of their
own, and each rack's bridge is joined to a core bridge by an uplink shaped each way.

Everything is made inside namespaces this module creates (the bridge too), so nothing in the
machine's own namespace changes and the hosts' subnet exists only among them. Names carry
the creating process's id and a token of the run (psar-PID-TOKEN-HOST), so runs never
collide; `clean_stale()` deletes what a killed run left (its process is gone). Needs root
and iproute2 (`ip`, `tc`): `unavailable()` says why not, in one line.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from dataclasses import dataclass, field

from experiments.runtime.iproute import (CMD_TIMEOUT_S, PREFIX, NetworkError, _alive, _kill_inside,  # noqa: F401
                                         _namespaces, clean_stale, congestion, has_netem, run,
                                         unavailable)
from experiments.runtime.linkmeter import PORT
from experiments.runtime.netprobes import Probes
from experiments.settings.net import NetConfig, parse_rate

IFNAME = "psar0"
"""Every host's interface to the bridge has this name, in its own namespace."""
SUBNET = "10.213.0"


@dataclass
class Host:
    name: str
    """The host's name in the run ("w0", "s1")."""
    netns: str
    """Its namespace (`ip netns exec NETNS ...`)."""
    addr: str
    """Its IPv4 address on the run's private subnet."""
    rack: int = 0
    """The rack whose switch its link joins."""

    ifname: str = IFNAME

    def argv(self, *cmd: str) -> list[str]:
        """cmd, run on this host."""
        return ["ip", "netns", "exec", self.netns, *map(str, cmd)]

    def counters(self) -> dict[str, int]:
        """Bytes and packets this host's link has sent and received so far."""
        out = {}
        for key in ("tx_bytes", "rx_bytes"):
            res = run("ip", "netns", "exec", self.netns, "cat", f"/sys/class/net/{self.ifname}/statistics/{key}")
            out[key] = int(res.stdout.strip())
        return out

    def tcp_counters(self) -> dict[str, int]:
        """What TCP on this host has done so far (its namespace's own counters, zero when the
        run's hosts were made): segments sent, segments sent again, and retransmission
        timeouts (each a stall of at least the kernel's minimum RTO, 200 ms by default)."""
        text = {f: run("ip", "netns", "exec", self.netns, "cat", f"/proc/net/{f}").stdout for f in ("snmp", "netstat")}
        return tcp_counters(text["snmp"], text["netstat"])


TCP_COUNTERS = {"segments_out": ("Tcp", "OutSegs"), "retransmitted": ("Tcp", "RetransSegs"),
                "timeouts": ("TcpExt", "TCPTimeouts")}
"""Host.tcp_counters's fields, by (table, field) of /proc/net/snmp and /proc/net/netstat."""


def tcp_counters(snmp: str, netstat: str) -> dict[str, int]:
    """TCP_COUNTERS read from the text of /proc/net/snmp and /proc/net/netstat (each table a
    line of names after "Table:" and a line of values); ValueError naming what is missing."""
    tables: dict[str, dict[str, str]] = {}
    for text in (snmp, netstat):
        lines = text.splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            table, _, fields = names.partition(":")
            tables.setdefault(table, {}).update(zip(fields.split(), values.partition(":")[2].split()))
    out = {}
    for name, (table, field_) in TCP_COUNTERS.items():
        value = tables.get(table, {}).get(field_)
        if value is None or not value.isdigit():
            raise ValueError(f"/proc/net: no {table} {field_} counter (got {value!r})")
        out[name] = int(value)
    return out


def tcp_totals(counters: list[dict[str, int]]) -> dict:
    """Over hosts' tcp_counters: the share of their segments sent again (0.0 where none was
    sent) and their retransmission timeouts."""
    sent = sum(c["segments_out"] for c in counters)
    return {"retransmitted": sum(c["retransmitted"] for c in counters) / sent if sent else 0.0,
            "timeouts": sum(c["timeouts"] for c in counters)}


QUEUE_MS = NetConfig.queue_ms
"""Most a link's queue holds past its burst by default (net.queue_ms), in milliseconds of its rate: a switch port's or
fq_codel's few milliseconds, not a bufferbloated 200 ms, behind which a host that sends and
receives at once also queues the ACKs of what it receives. With 200 ms of queue, a co-located
ps-sync step at 2 workers inside `psar compare link-scaling` took 1.45 and 1.58 s (one rank
waiting on the other every step) where alone it took 1.1 s; with 10 ms it took 1.11 s there."""

QUEUE_MIN_BYTES = 150_000
"""...and never less than about 100 full frames: 10 ms of a slow link is a few packets (17 at
20mbit), too few for two senders into one port. With 25 KB at 20mbit, one separate shard's
step at 2 workers took 1.85 to 2.26 s from run to run (tests/process/test_net_orderings.py)."""


HOST_QUEUE_BYTES = 4 << 20
"""Each class of a host's own egress queue holds this much: what TCP Small Queues lets one
flow keep below the socket here (net.ipv4.tcp_limit_output_bytes), so a host's own flows
never drop there. With a 350 KB drop-tail queue shared by a host's flows, 4 workers' pushes
to 4 separate shards lost 1.3 to 5% of their segments and one flow fell behind the others."""

SMALL_SHARE = 0.05
"""The share of a host's rate guaranteed to its small packets (ACKs); they may borrow the rest."""


@dataclass
class Network(Probes):
    """Hosts `names` on one bridge, every link shaped to `rate` both ways (htb where the host
    sends, tbf where the bridge sends), with
    `latency_ms` of netem delay each way where the kernel has netem.

    With `racks` (the rack of each host in `names`) naming more than one rack, each rack's
    hosts are on a bridge of their own (a rack switch), joined to one core bridge by a veth
    pair whose two ends are shaped with tbf to `uplink` (rack to core, core to rack), without
    delay; `uplink` "" leaves them unshaped. The hosts stay on one subnet: the bridges make
    one L2 network.

    Use as a context manager, or call up() and down(); down() runs on SIGTERM too, and
    clean_stale() removes what a SIGKILLed run left.
    """

    names: tuple[str, ...]
    rate: str = ""
    latency_ms: float = 0.0
    racks: tuple[int, ...] = ()
    """The rack of each host in `names`; empty: all in rack 0."""
    uplink: str = ""
    """Each rack's link to the core, each way, in tc's units; "": not shaped."""
    queue_ms: float = QUEUE_MS
    """What the bridge's side of a link (a switch port) queues past its burst, in ms of its rate."""
    congestion: str = NetConfig.congestion
    """TCP congestion control on every host, the first of these names the machine lets a
    namespace use (net.congestion; "": the machine's default, which they start with)."""
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: dict[str, Host] = field(default_factory=dict)
    created: list[str] = field(default_factory=list)
    congestion_in_use: str = ""
    """What the hosts' TCP ran (read off a host once they are up)."""

    @property
    def prefix(self) -> str:
        return f"{PREFIX}{os.getpid()}-{self.token}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def _add_netns(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self.created.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, netns: str, dev: str, rate: str = "", delay: bool = True) -> None:
        """Egress of dev in netns: tbf at rate (the hosts' where ""), and netem delay in front
        where it exists and delay is asked for."""
        rate = rate or self.rate
        burst = burst_bytes(parse_rate(rate))
        if self.latency_ms and delay:
            run("tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                "delay", f"{self.latency_ms}ms")
            parent = ("parent", "1:")
        else:
            parent = ("root",)
        run("tc", "-n", netns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
            "rate", rate, "burst", str(burst), "limit", str(self.queue_bytes(burst, rate)))

    def _shape_host(self, host: Host, index: int) -> None:
        """What a host sends, as a NIC under the kernel's fair queueing sends it: htb at the
        rate, one class per peer (so the host's flows to different peers share its link
        equally, as fq does), each over a queue its own flows never overflow (TCP Small
        Queues keeps a real host's flows from dropping at its own NIC), and its small packets
        (TCP ACKs of what it receives) ahead of its bulk data. The bridge's side of the link,
        a switch port, stays a short drop-tail queue (_shape)."""
        bits = parse_rate(self.rate)
        burst = burst_bytes(bits)
        root = "2:"
        lines = []
        if self.latency_ms:
            lines.append(f"qdisc add dev {IFNAME} root handle 1: netem delay {self.latency_ms}ms")
            lines.append(f"qdisc add dev {IFNAME} parent 1: handle {root} htb default 2")
        else:
            lines.append(f"qdisc add dev {IFNAME} root handle {root} htb default 2")
        cls = f"rate {int(bits)}bit ceil {int(bits)}bit burst {burst} cburst {burst}"
        lines.append(f"class add dev {IFNAME} parent {root} classid 2:1 htb {cls}")
        small = max(8_000, int(bits * SMALL_SHARE))
        lines.append(f"class add dev {IFNAME} parent 2:1 classid 2:2 htb rate {small}bit ceil {int(bits)}bit "
                     f"prio 0 burst {burst} cburst {burst}")
        lines.append(f"qdisc add dev {IFNAME} parent 2:2 bfifo limit {HOST_QUEUE_BYTES}")
        # IPv4 total length below 128 bytes: pure ACKs and the engines' small control messages.
        lines.append(f"filter add dev {IFNAME} parent {root} protocol ip prio 1 u32 "
                     f"match u16 0x0000 0xff80 at 2 flowid 2:2")
        peers = [i for i in range(len(self.names)) if i != index]
        share = int(bits * (1 - SMALL_SHARE) / max(1, len(peers)))
        for i in peers:
            cid = f"2:{16 + i:x}"
            lines.append(f"class add dev {IFNAME} parent 2:1 classid {cid} htb rate {max(8_000, share)}bit "
                         f"ceil {int(bits)}bit prio 1 quantum 3028 burst {burst} cburst {burst}")
            lines.append(f"qdisc add dev {IFNAME} parent {cid} bfifo limit {HOST_QUEUE_BYTES}")
            lines.append(f"filter add dev {IFNAME} parent {root} protocol ip prio 2 u32 "
                         f"match ip dst {_addr(i)}/32 flowid {cid}")
        run("tc", "-n", host.netns, "-batch", "-", input="\n".join(lines) + "\n")  # tc names a failing line

    def gso_bytes(self) -> int:
        """The largest packet the hosts build: one that fits the burst of every link it may
        cross (the hosts' and the uplinks'), gso_bytes."""
        slowest = min(parse_rate(r) for r in (self.rate, self.uplink) if r) if self.rate else 0.0
        return gso_bytes(slowest) if slowest else GSO_MAX_BYTES

    def queue_bytes(self, burst: int, rate: str = "") -> int:
        """tbf's limit: queue_ms of rate (the hosts' where "") past the burst, at least
        QUEUE_MIN_BYTES."""
        return max(QUEUE_MIN_BYTES, int(parse_rate(rate or self.rate) / 8 * self.queue_ms / 1000) + burst)

    @property
    def rack_count(self) -> int:
        """Racks up to the highest one a host is in (a rack below it may be empty)."""
        return max(self.racks, default=0) + 1

    def _switches(self) -> list[str]:
        """Make the bridges in the bridge namespace; the bridge of each rack, by rack. One rack
        is br0; more are rack0, rack1, ... and core, rack K joined to the core by the veth
        pair upK (the rack's port: what it sends goes up) and downK (the core's port)."""
        def bridge(name: str) -> str:
            run("ip", "-n", self.bridge_ns, "link", "add", name, "type", "bridge")
            run("ip", "-n", self.bridge_ns, "link", "set", name, "up")
            return name

        if self.rack_count == 1:
            return [bridge("br0")]
        core = bridge("core")
        racks = []
        for k in range(self.rack_count):
            racks.append(bridge(f"rack{k}"))
            up, down = f"up{k}", f"down{k}"
            run("ip", "-n", self.bridge_ns, "link", "add", up, "type", "veth", "peer", "name", down)
            for dev, master in ((up, racks[-1]), (down, core)):
                run("ip", "-n", self.bridge_ns, "link", "set", dev, "master", master)
                run("ip", "-n", self.bridge_ns, "link", "set", dev, "up")
                if self.uplink:
                    self._shape(self.bridge_ns, dev, self.uplink, delay=False)
        return racks

    def switch_bytes(self) -> dict[str, int]:
        """Bytes each switch port has sent so far, read at one instant, by interface: pI to
        host number I, upK from rack K to the core, downK from the core to rack K."""
        links = json.loads(run("ip", "-n", self.bridge_ns, "-j", "-s", "link", "show").stdout)
        return {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in links if PORT.fullmatch(link["ifname"])}

    def uplink_bytes(self) -> dict[int, dict[str, int]]:
        """Bytes each rack's uplink has carried so far, {rack: {"up_bytes": to the core,
        "down_bytes": from it}}; empty with one rack."""
        if self.rack_count == 1:
            return {}
        sent = self.switch_bytes()
        return {k: {"up_bytes": sent[f"up{k}"], "down_bytes": sent[f"down{k}"]} for k in range(self.rack_count)}

    def up(self) -> "Network":
        """Build the hosts; on any failure, what was built is torn down and NetworkError raised."""
        if len(self.names) > 250:
            raise ValueError(f"{len(self.names)} hosts: at most 250 on one subnet")
        if self.racks and (len(self.racks) != len(self.names) or min(self.racks) < 0):
            raise ValueError(f"racks {self.racks}: expected a rack index >= 0 for each of {len(self.names)} hosts")
        if self.uplink and self.rack_count == 1:
            raise ValueError(f"uplink {self.uplink}: one rack has no uplink; give the hosts' racks")
        try:
            self._add_netns(self.bridge_ns)
            switches = self._switches()
            packet = self.gso_bytes()
            for i, name in enumerate(self.names):
                host = Host(name, f"{self.prefix}-{name}", _addr(i), self.racks[i] if self.racks else 0)
                self._add_netns(host.netns)
                port = f"p{i}"
                # Both ends are born in the bridge's namespace, then one moves to the host's:
                # the machine's own namespace never sees either.
                run("ip", "-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", IFNAME)
                run("ip", "-n", self.bridge_ns, "link", "set", IFNAME, "netns", host.netns)
                run("ip", "-n", self.bridge_ns, "link", "set", port, "master", switches[host.rack])
                run("ip", "-n", self.bridge_ns, "link", "set", port, "up")
                if packet < GSO_MAX_BYTES:  # no packet larger than a link's burst
                    run("ip", "-n", host.netns, "link", "set", IFNAME, "gso_max_size", str(packet))
                run("ip", "-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", IFNAME)
                run("ip", "-n", host.netns, "link", "set", IFNAME, "up")
                if self.rate:
                    self._shape_host(host, i)          # what the host sends
                    self._shape(self.bridge_ns, port)  # what it receives
                if self.congestion or not self.hosts:  # chosen on the first host, set on every one
                    self.congestion_in_use = congestion(host.netns, self.congestion_in_use or self.congestion)
                self.hosts[name] = host
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> list[str]:
        """Kill what runs on the hosts, delete the namespaces (their veths and the bridge go
        with them); returns what could not be removed (empty when all went)."""
        problems = []
        for netns in reversed(self.created):
            stuck = _kill_inside(netns)
            if stuck:
                problems.append(f"processes {stuck} in {netns} would not die")
            res = run("ip", "netns", "del", netns, check=False)
            if res.returncode != 0:
                problems.append(f"`ip netns del {netns}`: {res.stderr.strip()}")
        self.created.clear()
        problems += [f"namespace {n} is still there" for n in _namespaces() if n.startswith(self.prefix + "-")]
        return problems

    def __enter__(self) -> "Network":
        self._old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
        return self.up()

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            for sig, handler in self._old.items():
                signal.signal(sig, handler)

    def describe(self) -> dict:
        """What summary.json records about the network."""
        racks = self.rack_count
        return {"rate": self.rate, "rate_bits": parse_rate(self.rate) if self.rate else None,
                "latency_ms": self.latency_ms, "queue_ms": self.queue_ms if self.rate else None,
                "congestion": self.congestion_in_use or None,
                "hosts": {n: h.addr for n, h in self.hosts.items()},
                "racks": racks, "rack_of": {n: h.rack for n, h in self.hosts.items()},
                "uplink": self.uplink, "uplink_bits": parse_rate(self.uplink) if self.uplink else None,
                # what a link lets through at once, and the largest packet a host builds (runs
                # before these were recorded had 4 ms of the rate and 64 KiB)
                "burst_bytes": burst_bytes(parse_rate(self.rate)) if self.rate else None,
                "packet_bytes": self.gso_bytes(),
                "made_with": ("network namespaces, a bridge" if racks == 1 else
                              "network namespaces, a bridge per rack joined to a core bridge by a veth pair"
                              + (" (tbf at the uplink rate each way)" if self.uplink else ""))
                             + ", veth links shaped with tc: htb with a class per peer and ACKs first where a "
                               "host sends, tbf where the bridge sends" + (" and netem delay" if self.latency_ms else "")}


def _addr(index: int) -> str:
    """The address of the run's host number index (0-based)."""
    return f"{SUBNET}.{index + 1}"


BURST_S = 0.001
"""What an emulated link lets through at once after an idle spell, in seconds of its rate (tbf
and htb need a burst; a real NIC or switch port sends nothing faster than its rate), at least
BURST_MIN_BYTES: a message below it, after the link was idle, leaves faster than the rate.
allreduce/auto.py's EMULATED_BURST_S prices it. With 4 ms, a step's small messages crossed
the links much faster than their rate: mlp-mid with 256-wide layers (1.1 MB of gradients), 4
workers at 1gbit, 30 steps, median step, alternated: ps-sync with 4 separate shards 12.9 and
14.6 ms with 4 ms, 21.5 and 21.7 with 1 ms (psar predict's rate-exact schedule: 22.0); the
ring 17.6 and 17.5 against 21.1 and 20.5. So the burst, not the engine, made the parameter
server 0.78x the ring's step there (1.04x with 1 ms; medians of the two runs). Bulk rates stay
exact with 1 ms: mlp-mid (23 MB) on 2 workers at 2gbit, the ring's median step 142.9 and
140.7 ms with 4 ms, 144.7 and 144.1 with 1 ms, 145.0 and 145.0 with 0.5 ms (the link alone:
92.8)."""


BURST_MIN_BYTES = 16_000
"""... and at least this many bytes: a few frames."""
GSO_MAX_BYTES = 65_536
"""The largest packet a host's TCP builds by default (a veth's gso_max_size, 64 KiB). tbf cuts
a packet larger than its burst into frames in software, at a cost: with 64 KiB packets and 1
ms of 200mbit (25 KB), 8 workers of mlp-mid with 256-wide layers, 30 steps, took 126 and 130
ms a step against 92 and 92 with 4 ms (100 KB), the host 10 times as long in soft interrupts.
So where a link's burst is smaller, its hosts build packets that fit it (gso_bytes): those
8 workers then took 103.9 and 103.4 ms, 2.5 times the soft interrupts of 64 KiB packets. Not
smaller everywhere: with 15 KB packets at 1gbit the ps-sync run of BURST_S took 30.7 ms a
step where 64 KiB ones took 21.5, and mlp-mid's ring at 2gbit 159 ms where they took 144."""


def gso_bytes(bits: float) -> int:
    """The largest packet for links of bits/s: one that fits their burst with its frames'
    headers (a tenth of it for them), at most GSO_MAX_BYTES."""
    return min(GSO_MAX_BYTES, int(burst_bytes(bits) * 0.9))


def burst_bytes(bits: float) -> int:
    """A burst of BURST_S of traffic at bits/s, at least BURST_MIN_BYTES."""
    return max(BURST_MIN_BYTES, int(bits / 8 * BURST_S))


def _interrupt(signum, frame):
    """SIGTERM and SIGHUP unwind like Ctrl-C, so that the namespaces are removed on the way out."""
    raise KeyboardInterrupt(f"signal {signum}")
