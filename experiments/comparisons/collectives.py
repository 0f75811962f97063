"""The measurements of `psar compare collectives` before its training grid: every all-reduce
algorithm at message sizes from 4 KB to 64 MB, on emulated networks flat and in two racks
behind an oversubscribed uplink, with and without a per-message latency, each beside the
alpha-beta model's time (allreduce/plancost.py). Writes collectives.json in the output
directory; analysis/collectives.py makes its table and figures."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from allreduce.auto import EMULATED_BURST_S, LINK_MESSAGE_S, crowding, pieces, predict
from analysis.linkmodel import PAYLOAD
from experiments.rundir import files
from experiments.runtime.launcher import run_ranks
from experiments.runtime.netns import burst_bytes
from experiments.runtime.sites import Emulated
from experiments.settings.net import NetConfig, parse_rate

RATE = "1gbit"
"""Every host's link: fast enough that 64 MB takes about a second on the ring, slow enough
that 2 cores keep 8 shaped links busy."""
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
ALGORITHMS = ("library", "ring", "halving-doubling", "tree", "hierarchical", "auto")
LATENCY_MS = 5.0
OVERSUBSCRIPTION = 4
"""A rack of k hosts at RATE behind an uplink of k * RATE / 4."""


@dataclass(frozen=True)
class Topology:
    ranks: int
    racks: int = 1
    latency_ms: float = 0.0
    sizes: tuple[int, ...] = SIZES

    @property
    def name(self) -> str:
        where = f"{self.racks} racks {OVERSUBSCRIPTION}:1" if self.racks > 1 else "flat"
        return f"{self.ranks} ranks, {where}" + (f", {self.latency_ms:g} ms" if self.latency_ms else "")

    def net(self) -> NetConfig:
        uplink = ""
        if self.racks > 1:
            uplink = f"{int(parse_rate(RATE) * self.ranks / self.racks / OVERSUBSCRIPTION / 1e6)}mbit"
        return NetConfig(rate=RATE, latency_ms=self.latency_ms, racks=self.racks, uplink=uplink)


def topologies(cores: int | None = None) -> tuple[Topology, ...]:
    """4 ranks flat, with latency and in two racks; 8 ranks the same where there are 4 cores
    or more (on 2, 8 ranks' processes and shaped links measure the CPU; their 64 MB is left out)."""
    cores = cores or os.cpu_count() or 1
    four = (Topology(4), Topology(4, latency_ms=LATENCY_MS, sizes=SIZES[:3]), Topology(4, racks=2))
    eight = (Topology(8, sizes=SIZES[:4]), Topology(8, latency_ms=LATENCY_MS, sizes=SIZES[:3]),
             Topology(8, racks=2, sizes=SIZES[:4]))
    return four + (eight if cores >= 4 else eight[2:])


def model_s(algorithm: str, nbytes: int, topo: Topology, net: NetConfig, alpha: bool = True) -> float:
    """The alpha-beta model's seconds for what ran (the library's: Gloo's ring, in rank order),
    at the links' TCP payload rate (analysis/linkmodel.py's PAYLOAD) with their burst, its
    messages' cost for ranks sharing this machine's cores; alpha=False: its links' part alone."""
    racks = tuple(net.worker_rack(r, topo.ranks) for r in range(topo.ranks)) if topo.racks > 1 else None
    uplink = parse_rate(net.uplink) * PAYLOAD / 8 if net.uplink else None
    crowded = crowding(topo.ranks)
    a, per = (topo.latency_ms / 1e3, LINK_MESSAGE_S * crowded) if alpha else (0.0, 0.0)
    algo = "ring" if algorithm == "library" else algorithm
    return predict(algo, nbytes, topo.ranks, a, parse_rate(net.rate) * PAYLOAD / 8, racks, uplink,
                   pieces(nbytes, algo, True, crowded), per, EMULATED_BURST_S)


def measure(out: Path, echo: Callable[[str], None] = print, rounds: int = 3) -> Path:
    """Run every topology's sweep; write and return out/collectives.json."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for topo in topologies():
        net = topo.net()
        algorithms = [a for a in ALGORITHMS if a != "hierarchical" or topo.racks > 1]
        echo(f"collectives: {topo.name} at {RATE} ({', '.join(algorithms)})")
        with Emulated(net, topo.ranks, 0) as sites:
            racks = [net.worker_rack(r, topo.ranks) for r in range(topo.ranks)]
            spec = {"sizes": list(topo.sizes), "algorithms": algorithms, "racks": racks if topo.racks > 1 else None,
                    "delay_s": topo.latency_ms / 1e3 if sites.latency_by.startswith("engine") else 0.0,
                    "bandwidth": parse_rate(RATE) / 8, "rounds": rounds, "budget_s": 0.3, "block_s": 0.0,
                    "uplink": parse_rate(net.uplink) / 8 if net.uplink else None, "crowded": crowding(topo.ranks)}
            tag = topo.name.replace(", ", "-").replace(" ", "").replace(":", "to")
            spec_path, result = out / f"collectives-{tag}.spec.json", out / f"collectives-{tag}.json"
            files.write_json(spec_path, spec)
            run_ranks([sys.executable, "-m", "allreduce.benchmark", str(result), "--spec", str(spec_path)],
                      topo.ranks, out / "logs" / f"collectives-{tag}", deadline_s=900, sites=sites)
        for row in json.loads(result.read_text())["rows"]:
            rows.append({**row, "topology": topo.name, **asdict(topo), "sizes": None, "rate": RATE,
                         "burst_bytes": burst_bytes(parse_rate(RATE)),
                         "uplink": net.uplink, "model_us": 1e6 * model_s(row["ran"], row["bytes"], topo, net),
                         "model_link_us": 1e6 * model_s(row["ran"], row["bytes"], topo, net, alpha=False)})
    path = out / "collectives.json"
    files.write_json(path, {"rate": RATE, "rows": rows})
    return path
