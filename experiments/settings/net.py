"""The emulated cluster a run asks for (--net RATE, net.*): its config and tc's rate syntax.
experiments/runtime/netns.py builds it."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


PLACEMENTS = ("colocated", "separate")


@dataclass(frozen=True)
class NetConfig:
    """An emulated cluster for `psar run` and `psar compare` on one machine (--net RATE)."""

    rate: str = ""
    """Every host's link, each way, in tc's units (200mbit, 1gbit); "": no emulated network,
    every process on loopback."""
    latency_ms: float = 0.0
    """One-way delay on every link: netem where the kernel has it, else the engines'
    per-message delay (fault.delay_ms); summary.json records which."""
    queue_ms: float = 10.0
    """What a switch port queues past its burst, in milliseconds of its rate (at least 150 KB):
    a shallow-buffered switch's few milliseconds by default. A port several hosts send into
    at once (a shard's, under a parameter server) drops what overflows it, and TCP sends it
    again; a deep-buffered switch (100 ms or more) queues it instead. mlp-mid ps-sync x4 on 4
    separate shards at 100mbit, 12 steps, two runs each: 2.66 and 2.68 s a step at 10 ms (3.7
    and 3.8% of segments sent again), 2.14 and 2.15 s at 300 ms (0.01%)."""
    congestion: str = "cubic,reno"
    """TCP congestion control on every emulated host: the first of these names (in order) that
    the machine lets a network namespace use (net.ipv4.tcp_allowed_congestion_control), or ""
    for the machine's own default, which a new namespace starts with; summary.json's
    network.congestion says which ran. By default a loss-based one, as a cluster's Linux hosts
    run (cubic; reno where namespaces may not take cubic: at sub-millisecond round trips cubic
    grows its window as reno does, and cuts it to 0.7 on a loss where reno's goes to 0.5).
    Flows that ignore loss (bbr) overflow a shallow port that several hosts send into: 4 hosts
    sending 270 KB each at once into one host's 100mbit port (10 ms of queue), 30 rounds 50 ms
    apart, four runs each, alternated (`psar bench`'s incast table, on links with a burst of 1
    ms of the rate): bbr sent 28 to 30% of its segments again, with 2 to 10 retransmission
    timeouts a run, its slowest tenth of rounds 3.1 to 3.4x the port's time; reno 1.7 to 2.1%,
    0 or 1 timeouts, 1.04 to 2.36x (the median round 1.03 to 1.04x under both). With the 4 ms
    burst the links had before: bbr 29 to 36%, reno 2.8 to 3.3%."""
    placement: str = "colocated"
    """Parameter-server shards on the workers' hosts (shard i on worker i's host, as BytePS
    co-locates them), or "separate": a host of their own each (spare CPU machines)."""
    racks: int = 1
    """Racks of hosts: each rack's hosts on a switch of their own, each rack switch joined to
    one core switch by an uplink (net.uplink); 1: every host on one switch. Without --net RATE
    nothing is emulated: the racks only group the workers for allreduce.algorithm=hierarchical
    and auto (the racks of a real cluster's hosts under `psar launch`)."""
    uplink: str = ""
    """Each rack's link to the core, each way, in tc's units: a rack of k hosts behind an
    uplink below k x RATE is oversubscribed; "": not shaped (the core is no bottleneck).
    Needs net.racks above 1."""
    worker_racks: str = ""
    """The rack of each worker in rank order, a comma list of rack indices ("0,0,1,1");
    "": round-robin, worker r in rack r % net.racks."""
    server_racks: str = ""
    """The rack of each separate shard (net.placement=separate) in shard order, as
    net.worker_racks; "": round-robin, shard s in rack s % net.racks. A co-located shard is
    in its worker's rack."""

    def __post_init__(self) -> None:
        if self.rate:
            parse_rate(self.rate)
        if not (isinstance(self.racks, int) and self.racks >= 1):
            raise ValueError(f"net.racks={self.racks}: must be an int >= 1")
        if self.uplink:
            try:
                parse_rate(self.uplink)
            except ValueError as err:
                raise ValueError(f"net.uplink={self.uplink!r}: {err}") from None
        _rack_list("worker_racks", self.worker_racks)
        _rack_list("server_racks", self.server_racks)
        if self.placement not in PLACEMENTS:
            raise ValueError(f"net.placement={self.placement!r}: expected one of {', '.join(PLACEMENTS)}")
        if not self.latency_ms >= 0:
            raise ValueError(f"net.latency_ms={self.latency_ms}: must be >= 0")
        if self.latency_ms and not self.rate:
            raise ValueError("net.latency_ms needs an emulated network: give --net RATE too")
        if not (self.queue_ms > 0 and math.isfinite(self.queue_ms)):
            raise ValueError(f"net.queue_ms={self.queue_ms}: must be a finite number > 0")
        if self.congestion and not re.fullmatch(r"[a-z][a-z0-9_]{0,15}(,[a-z][a-z0-9_]{0,15})*", self.congestion):
            raise ValueError(f"net.congestion={self.congestion!r}: expected a TCP congestion control's name, "
                             "such as reno, cubic or bbr, or several comma-separated in order of preference")

    def check(self, workers: int, servers: int | None) -> None:
        """The racks against each other and against the run's hosts, once every override is in
        (net.racks may come after net.uplink): workers, and the separate shards' count (None
        where the engine runs no shards, so net.server_racks is not its concern)."""
        if self.uplink and not self.rate:
            raise ValueError(f"net.uplink={self.uplink} shapes an emulated network: give --net RATE too")
        if self.queue_ms != NetConfig.queue_ms and not self.rate:
            raise ValueError(f"net.queue_ms={self.queue_ms:g} sizes an emulated switch port's queue: "
                             "give --net RATE too")
        if self.congestion not in ("", NetConfig.congestion) and not self.rate:  # "": runs made before the default
            raise ValueError(f"net.congestion={self.congestion} sets the emulated hosts' TCP: give --net RATE too")
        if self.uplink and self.racks == 1:
            raise ValueError(f"net.uplink={self.uplink} joins racks to the core: set net.racks above 1 too")
        if self.server_racks and self.placement == "colocated":
            raise ValueError(f"net.server_racks={self.server_racks!r}: co-located shards are in their "
                             "workers' racks; set net.placement=separate or leave net.server_racks out")
        for rank in range(workers):
            self.worker_rack(rank, workers)
        for shard in range(servers or 0):
            self.server_rack(shard, servers, workers)

    def worker_rack(self, rank: int, workers: int) -> int:
        """The rack of worker `rank` of `workers`: net.worker_racks's entry, or rank % racks.
        ValueError naming net.worker_racks when it does not fit."""
        return self._rack("worker_racks", rank, workers, "workers")

    def server_rack(self, shard: int, servers: int, workers: int = 0) -> int:
        """The rack of server shard `shard` of `servers`: a separate shard's net.server_racks
        entry, or shard % racks; a co-located shard's is its worker's (shard % workers, so
        workers must be given). ValueError naming the setting that does not fit."""
        if self.placement == "colocated":
            if workers < 1:
                raise ValueError("a co-located shard is in its worker's rack: server_rack needs the workers")
            return self.worker_rack(shard % workers, workers)
        return self._rack("server_racks", shard, servers, "separate shards")

    def _rack(self, key: str, index: int, count: int, what: str) -> int:
        if not 0 <= index < count:
            raise ValueError(f"{index} is not one of {count} {what}")
        given = _rack_list(key, getattr(self, key))
        if not given:
            return index % self.racks
        if len(given) != count:
            raise ValueError(f"net.{key}={getattr(self, key)!r} places {len(given)} hosts; "
                             f"the run has {count} {what}: give one rack each")
        bad = [r for r in given if r >= self.racks]
        if bad:
            raise ValueError(f"net.{key}={getattr(self, key)!r}: rack {bad[0]} is not one of "
                             f"net.racks={self.racks} (0..{self.racks - 1})")
        return given[index]


def _rack_list(key: str, text: str) -> tuple[int, ...]:
    """net.KEY's comma list of rack indices; ValueError naming net.KEY if an entry is not one."""
    if not text.strip():
        return ()
    try:
        racks = tuple(int(part) for part in text.split(","))
    except ValueError:
        racks = ()
    if not racks or min(racks) < 0:
        raise ValueError(f"net.{key}={text!r}: expected a comma list of rack indices >= 0, e.g. 0,0,1,1")
    return racks


def parse_rate(rate: str) -> float:
    """tc's rate syntax ("200mbit", "1gbit", "10mbps": bytes) in bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", rate or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of tc's units "
                         f"({', '.join(_UNITS)}), e.g. 200mbit")
    bits = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be above 0")
    return bits
