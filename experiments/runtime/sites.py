"""Where the processes of a run live: all on loopback, or each on a host of an emulated
cluster (--net RATE). The launcher asks a Sites object for each process's address and for
the command line that starts it there; nothing else knows whether a link is shaped."""

from __future__ import annotations

import dataclasses
import random
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.settings.config import RunConfig
from experiments.runtime.linkmeter import LINKS_FILE, LinkMeter
from experiments.runtime.netns import Network, clean_stale, has_netem, tcp_totals, unavailable
from experiments.settings.net import NetConfig, parse_rate

MASTER_PORT = 29500  # an emulated host is a new namespace: its ports are all free
SERVER_PORT = 5555


_GIVEN: set[int] = set()
_pick = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel picks from for bind(port 0) and for a connection's own end."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port free on this host now, below the kernel's ephemeral range, and not given
    before by this process.

    A launch's ports (its rendezvous, its server shards) are chosen before its processes
    start and bound seconds later: one from the ephemeral range could be taken meanwhile by a
    connection or by one of Gloo's listening sockets (bind to port 0), which the kernel picks
    from that range. Ports below it are bound only by those who name them.
    """
    low, _ = ephemeral_range()
    start = max(1024, low - 20000)
    for _ in range(1000 if low - start >= 1000 else 0):
        port = _pick.randrange(start, low)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Site:
    """One process's place: its address, and how to start a command there."""

    addr: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()
    ifname: str = ""
    """The interface Gloo must use ("" on loopback: its own choice)."""

    def wrap(self, argv: list[str]) -> list[str]:
        return [*self.prefix, *argv]


class Loopback:
    """Every process on 127.0.0.1, on ports that are free now."""

    def __enter__(self) -> "Loopback":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def adjust(self, cfg: RunConfig) -> RunConfig:
        return cfg

    def worker(self, rank: int) -> Site:
        return Site()

    def server(self, shard: int) -> Site:
        return Site()

    def master_port(self, restarts: int = 0) -> int:
        return free_port()

    def server_port(self, shard: int) -> int:
        return free_port()

    def record(self) -> dict | None:
        return None

    def links(self) -> dict | None:
        return None


class Emulated:
    """A host per worker and, with net.placement=separate, per server shard (co-located
    shard i shares worker i's host), every link shaped to net.rate each way; with net.racks,
    each host in its rack (net.worker_racks, net.server_racks) behind net.uplink."""

    def __init__(self, net: NetConfig, workers: int, servers: int) -> None:
        self.net, self.workers, self.servers = net, workers, servers
        self.network: Network | None = None
        self.meter: LinkMeter | None = None
        self.latency_by = ""

    def __enter__(self) -> "Emulated":
        reason = unavailable()
        if reason:
            raise RuntimeError(f"--net {self.net.rate}: {reason}")
        clean_stale()  # what a killed run left behind
        separate = self.net.placement == "separate"
        shards = range(self.servers if separate else 0)
        names = [f"w{r}" for r in range(self.workers)] + [f"s{s}" for s in shards]
        racks = [self.net.worker_rack(r, self.workers) for r in range(self.workers)]
        racks += [self.net.server_rack(s, self.servers) for s in shards]
        netem = bool(self.net.latency_ms) and has_netem()
        self.latency_by = ("netem" if netem else "engine (fault.delay_ms)") if self.net.latency_ms else ""
        self.network = Network(tuple(names), self.net.rate, self.net.latency_ms if netem else 0.0,
                               racks=tuple(racks), uplink=self.net.uplink, queue_ms=self.net.queue_ms,
                               congestion=self.net.congestion)
        self.network.__enter__()
        try:
            self.meter = LinkMeter(self.network.bridge_ns, self.network.names).start()
        except OSError as err:  # the run goes on without its links' timeline
            print(f"psar: no {LINKS_FILE}: {err}", file=sys.stderr)
        except BaseException:
            self.network.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.meter is not None:
            self.meter.stop()
        if self.network is not None:
            self.network.__exit__(*exc)

    def links(self) -> dict | None:
        """What each link carried over the run so far, read every few ms (linkmeter.LinkMeter's
        timeline; None where the meter could not start); stops the reading, and says on stderr
        why it stopped early where it did."""
        return None if self.meter is None else self.meter.finish(LINKS_FILE)

    def adjust(self, cfg: RunConfig) -> RunConfig:
        """Latency the kernel cannot add (no netem) is added by the engines instead."""
        if self.latency_by.startswith("engine"):
            fault = dataclasses.replace(cfg.fault, delay_ms=cfg.fault.delay_ms + self.net.latency_ms)
            return dataclasses.replace(cfg, fault=fault)
        return cfg

    def _site(self, name: str) -> Site:
        host = self.network.hosts[name]
        return Site(host.addr, tuple(host.argv()), host.ifname)

    def worker(self, rank: int) -> Site:
        return self._site(f"w{rank}")

    def server(self, shard: int) -> Site:
        separate = self.net.placement == "separate"
        return self._site(f"s{shard}" if separate else f"w{shard % self.workers}")

    def master_port(self, restarts: int = 0) -> int:
        """The rendezvous port on rank 0's host: a new one after each restart, so that a
        listening socket of the stopped job never stands in the way."""
        return MASTER_PORT + restarts

    def server_port(self, shard: int) -> int:
        return SERVER_PORT + shard  # co-located shards share a host, not a port

    def record(self) -> dict:
        """The network for summary.json: what it was and what each host's link carried, and
        with racks what each rack's uplink carried (up: to the core) and its link time; what
        TCP did on each host (tcp: segments sent, sent again, timeouts), and over all hosts the
        share of segments sent again (retransmitted) and the timeouts: packets the links'
        short queues dropped, where several hosts send into one port at once (incast)."""
        bits = parse_rate(self.net.rate)
        hosts = {}
        for name, host in self.network.hosts.items():
            c = host.counters()
            hosts[name] = {"addr": host.addr, "rack": host.rack, **c,
                           "link_s": max(c["tx_bytes"], c["rx_bytes"]) * 8 / bits, "tcp": host.tcp_counters()}
        uplinks = {}
        for rack, c in self.network.uplink_bytes().items():
            busiest = max(c["up_bytes"], c["down_bytes"]) * 8
            uplinks[str(rack)] = {**c, "link_s": busiest / parse_rate(self.net.uplink) if self.net.uplink else None}
        return {**self.network.describe(), "placement": self.net.placement,
                "latency_by": self.latency_by, "hosts": hosts, "uplinks": uplinks,
                **tcp_totals([h["tcp"] for h in hosts.values()])}


def sites_for(net: NetConfig, workers: int, servers: int) -> Loopback | Emulated:
    return Emulated(net, workers, servers) if net.rate else Loopback()
