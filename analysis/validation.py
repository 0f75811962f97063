"""psar predict checked on held-out runs (analysis/predict.validate): the table `psar predict
--validate` prints, and `psar compare predict`'s report."""

from __future__ import annotations

from pathlib import Path

from experiments.rundir.files import write_json

from .hostcpu import SATURATED
from .predict import Machine, validate
from .results import Run

WITHIN = 0.15
"""The error a link-bound row is held to."""

IDLE = 0.5
"""A held-out run whose busiest class of links carried less than this share of a step at
their rate (analysis/links.busiest) spent most of its step on something else."""

SLOWED = 1.5
"""A held-out run whose workers' own compute (its step less its exchange, costmodel.compute_time)
took this many times its calibration's or more: where one machine runs more ranks and shards
than it has cores, each waits its turn; a cluster's hosts would each have their own."""

DROPPING = 0.01
"""A run whose links sent this share of its segments again dropped packets where its
calibration's, below a fifth of it, did not: `psar predict` plays links that never drop."""


def table(rows: list[dict]) -> str:
    """Each held-out run: its cluster, measured and predicted median step, the error, the
    error of the played exchange alone (against the run's step less its own compute: on one
    machine a larger run's workers share its cores, and its compute grows with them, which a
    prediction for a cluster leaves out; so an exchange played too long can hide behind
    it), how busy its busiest links were (links: their share of a step at their rate), the
    share of its TCP segments sent again beside its calibration's (retx %: packets the links
    dropped); then how many link-bound rows are within WITHIN, and which of those outside it
    had links mostly idle (IDLE), ran on saturated cores (cpu: the share of the host's cores in
    use, analysis/hostcpu.SATURATED), computed SLOWED times as long as their calibration or
    more, or dropped packets their calibration did not."""
    lines = [f"{'engine':<36}{'workers':>8}{'servers':>8}{'net':>9}{'racks':>6}{'lat ms':>7}{'measured ms':>12}"
             f"{'predicted ms':>13}{'error':>8}{'exchange':>10}  link-bound  links   cpu  retx % (calibration)"]
    for r in rows:
        lines.append(f"{r['engine']:<36}{r['workers']:>8}{r['servers'] or '':>8}{r['rate_bits'] / 1e6:>6.0f}mbit"
                     f"{r['racks']:>6}{1e3 * r['latency_s']:>7.0f}{1e3 * r['measured_s']:>12.1f}"
                     f"{1e3 * r['step_s']:>13.1f}{100 * r['error']:>7.1f}%{_percent(r.get('exchange_error')):>10}"
                     f"  {'yes' if r['link_bound'] else 'no ':<10}{_busy(r.get('links_busy')):>7}"
                     f"{_busy(r.get('host_cpu')):>6}"
                     f"  {_share(r.get('retransmitted'))} ({_share(r.get('calibration_retransmitted'))})")
    bound = [abs(r["error"]) for r in rows if r["link_bound"]]
    if bound:
        lines.append(f"link-bound rows: {sum(e <= WITHIN for e in bound)} of {len(bound)} within "
                     f"{100 * WITHIN:.0f}%, largest error {100 * max(bound):.1f}%")
    exchanges = [abs(r["exchange_error"]) for r in rows if r["link_bound"] and r.get("exchange_error") is not None]
    if exchanges:
        lines.append(f"their exchange alone (the played exchange against each run's step less its own compute): "
                     f"{sum(e <= WITHIN for e in exchanges)} of {len(exchanges)} within {100 * WITHIN:.0f}%, "
                     f"largest error {100 * max(exchanges):.1f}%")
    outside = [r for r in rows if r["link_bound"] and abs(r["error"]) > WITHIN]
    idle = [r for r in outside if r.get("links_busy") is not None and r["links_busy"] < IDLE]
    if idle:
        lines.append(f"{len(idle)} of them outside {100 * WITHIN:.0f}% had their busiest links carry less than "
                     f"{100 * IDLE:.0f}% of a step at their rate (links: psar links): their steps waited on "
                     "something other than the links' rates (where one machine emulates every host: its cores, "
                     "which carry the links too)")
    saturated = [r for r in outside if r.get("host_cpu") is not None and r["host_cpu"] >= SATURATED]
    if saturated:
        lines.append(f"{len(saturated)} of them outside {100 * WITHIN:.0f}% ran on a host whose cores were "
                     f"{100 * SATURATED:.0f}% in use or more through their steps (cpu: psar links): there the "
                     "machine's cores, shared by every worker, shard and emulated link, set the pace as much as "
                     "the links, which a cluster's hosts would not share")
    slowed = [r for r in outside if r.get("measured_compute_s") and r.get("compute_s")
              and r["measured_compute_s"] >= SLOWED * r["compute_s"]]
    if slowed:
        grown = [r["measured_compute_s"] / r["compute_s"] for r in slowed]
        crowded = [r for r in slowed if r.get("host_cores") and r["workers"] + (r["servers"] or 0) > r["host_cores"]]
        lines.append(f"{len(slowed)} of them outside {100 * WITHIN:.0f}% computed {min(grown):.1f} to "
                     f"{max(grown):.1f} times as long a step as their calibration (their step less their exchange)"
                     + (f"; {len(crowded)} of those ran more ranks and shards than the machine has cores, each "
                        "waiting its turn, where a cluster's hosts would each have their own" if crowded else "")
                     + "; the exchange column sets their compute apart")
    dropping = [r for r in outside if _drops_anew(r)]
    if dropping:
        lines.append(f"{len(dropping)} of them outside {100 * WITHIN:.0f}% sent {100 * DROPPING:.0f}% or more of "
                     "their segments again, their calibration under a fifth of that: their links' queues dropped "
                     "packets (several hosts sending into one port), which psar predict's links never do; a step "
                     "that waits on every flow (ps-sync's answer to a key waits for every worker's push) loses most; "
                     "runs with deep-buffered ports (--set net.queue_ms=300) queue what these dropped")
    other = [r for r in rows if r.get("congestion") and r.get("calibration_congestion")
             and r["congestion"] != r["calibration_congestion"]]
    if other:
        pairs = sorted({f"{r['congestion']} against {r['calibration_congestion']}" for r in other})
        lines.append(f"{len(other)} held-out run(s) ran another TCP than their calibration ({'; '.join(pairs)}): "
                     "where several hosts send into one port it changes what the links drop "
                     "(net.congestion; docs/emulated-clusters.md#tcp)")
    return "\n".join(lines)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _busy(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _drops_anew(row: dict) -> bool:
    """The held-out run dropped packets (DROPPING) where its calibration dropped under a fifth
    as many (unknown counts as not)."""
    held, calibration = row.get("retransmitted"), row.get("calibration_retransmitted")
    return held is not None and calibration is not None and held >= DROPPING and calibration < held / 5


def report(runs: list[Run], out: Path) -> tuple[str, list[Path]]:
    """`psar compare predict`'s report: the table, and its rows in out/validation.json. Where
    out holds a bench.json (experiments/comparisons/machine.py measured it before the grid), a
    message costs what it says on these runs' machine (its ring's in psar's own collectives),
    and their links together carry what it says; else the defaults (250 us, unlimited)."""
    bench = Path(out) / "bench.json"
    machine = Machine.from_bench(bench) if bench.exists() else Machine()
    message, own, fabric = machine.message, machine.own_message, machine.fabric
    rows = validate(runs, message=message, fabric=fabric, own_message=own)
    path = write_json(Path(out) / "validation.json", rows, indent=1)
    cost = f"; a message {1e6 * message:.0f} us" if message is not None else ""
    cost += f" ({1e6 * own:.0f} in psar's own collectives)" if own is not None and own != message else ""
    cost += f"; the links {fabric / 1e6:.0f} MB/s all together" if fabric is not None else ""
    cost += f", from {bench}" if cost else ""
    return f"psar predict on the held-out runs (calibrated on the 2-worker runs alone{cost}):\n" + table(rows), [path]
