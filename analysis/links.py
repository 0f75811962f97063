"""How busy each emulated link was during a run's steps, read off its links.json (the bridge's
port counters every few ms, experiments/runtime/linkmeter.py) and rank 0's step ends.

A link's share of a step is the bytes it carried between the step's two ends over what its
rate carries in that time (frames as the port counts them, TCP/IP and Ethernet headers
included; a link that never waits reads 0.95 to 0.97 on this project's shapers). The median step's share says how
much of a step the links were idle; the tenths of a step say when: a parameter server's
worker links idle at the start of a step while backward runs and at its end while the last
keys' replies come, a ring's links through its phases' hops.
"""

from __future__ import annotations

import bisect
import json
from statistics import median

from experiments.runtime.linkmeter import LINKS_FILE

from .results import Run

TENTHS = 10

CLASSES = (("workers sent", "w", " sent"), ("workers received", "w", " received"),
           ("shards sent", "s", " sent"), ("shards received", "s", " received"),
           ("uplinks up", "up:", ""), ("uplinks down", "down:", ""))
"""(name, a link's prefix, its suffix): the links a row of the table takes together."""


def is_uplink(link: str) -> bool:
    """Whether a link of the timeline is a rack's uplink ("up:rK", "down:rK"), not a host's."""
    return link.startswith(("up:", "down:"))


def timeline(run: Run) -> dict | None:
    """The run's links.json (None where it has none: loopback, or a run from before it)."""
    return read_timeline(run.path / LINKS_FILE, "links", "the links' timeline")


def read_timeline(path, key: str, what: str) -> dict | None:
    """A meter's timeline as experiments/runtime/meter.py writes it ({"t", key: {name:
    counts}}), checked: at least two readings, as many of each count as of times; None where
    the file is not there, ValueError naming it (and `what`) where it cannot be read."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if len(data["t"]) < 2 or any(len(v) != len(data["t"]) for v in data[key].values()):
            raise ValueError(f"the readings of a counter of {key!r} and the times differ in number")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: cannot read {what}: {err}") from None
    return data


def carried(times: list[float], counts: list[int], t0: float, t1: float) -> float:
    """Bytes of a cumulative count between wall times t0 and t1, the count taken as growing
    evenly between two readings (times in order)."""
    return _at(times, counts, t1) - _at(times, counts, t0)


def _at(times: list[float], counts: list[int], t: float) -> float:
    i = bisect.bisect_right(times, t)
    if i == 0:
        return float(counts[0])
    if i == len(times):
        return float(counts[-1])
    t0, t1 = times[i - 1], times[i]
    return counts[i - 1] + (counts[i] - counts[i - 1]) * (t - t0) / (t1 - t0)


def steps(run: Run, within: tuple[float, float] = (float("-inf"), float("inf"))) -> list[tuple[float, float]]:
    """(start, end) on the wall clock of rank 0's steps after the first (warm-up), each from
    the end of the one before it in the same process (not across a restart), that lie within
    `within` (the timeline's: a resumed run's earlier steps are another launch's)."""
    records = [r for r in run.metrics.get(0, []) if "wall" in r]
    return [(a["wall"], b["wall"]) for a, b in zip(records, records[1:])
            if b["step"] == a["step"] + 1 and b["time"] > a["time"] and within[0] <= a["wall"] < b["wall"] <= within[1]]


def rates(run: Run) -> tuple[float, float | None]:
    """(a host's link, a rack's uplink) in bytes/s, from summary.json's network."""
    net = run.summary.get("network") or {}
    if not net.get("rate_bits"):
        raise ValueError(f"{run.path}: no emulated network in summary.json")
    uplink = net.get("uplink_bits")
    return net["rate_bits"] / 8, uplink / 8 if uplink else None


def busy(run: Run) -> dict | None:
    """{"links": {link: its share of each step (median over the steps)}, "tenths": {link: its
    share in each tenth of a step (mean over the steps)}, "classes": by CLASSES, {name:
    {"busy": the class's links' median share, "tenths": the mean over its links}}, "fine":
    whether the readings are no further apart than a tenth of the median step}; None where the
    run has no timeline or no whole step."""
    data = timeline(run)
    if data is None:
        return None
    windows = steps(run, (data["t"][0], data["t"][-1]))
    if not windows:
        return None
    host, uplink = rates(run)
    t = data["t"]
    shares: dict[str, float] = {}
    tenths: dict[str, list[float]] = {}
    for link, counts in data["links"].items():
        rate = uplink if is_uplink(link) else host
        if rate is None:
            continue
        shares[link] = median(carried(t, counts, a, b) / (rate * (b - a)) for a, b in windows)
        tenths[link] = [sum(carried(t, counts, a + (b - a) * k / TENTHS, a + (b - a) * (k + 1) / TENTHS)
                            / (rate * (b - a) / TENTHS) for a, b in windows) / len(windows) for k in range(TENTHS)]
    classes = {}
    for name, prefix, suffix in CLASSES:
        members = [link for link in shares if link.startswith(prefix) and link.endswith(suffix)]
        if members:
            classes[name] = {"busy": median(shares[m] for m in members), "links": len(members),
                             "tenths": [sum(tenths[m][k] for m in members) / len(members) for k in range(TENTHS)]}
    step_s = median(b - a for a, b in windows)
    return {"links": shares, "tenths": tenths, "classes": classes, "steps": len(windows),
            "interval_s": data["interval_s"], "step_s": step_s, "fine": data["interval_s"] <= step_s / TENTHS}


def links_busy(run: Run) -> float | None:
    """The median of the hosts' links' shares of a step (both ways; uplinks apart), None
    without a timeline."""
    found = busy(run)
    if found is None:
        return None
    hosts = [share for link, share in found["links"].items() if not is_uplink(link)]
    return median(hosts) if hosts else None


def busiest(run: Run) -> tuple[str, float] | None:
    """(name, share) of the class of links (CLASSES) busiest over the run's steps (median of
    its links), None without a timeline."""
    found = busy(run)
    if found is None or not found["classes"]:
        return None
    name, c = max(found["classes"].items(), key=lambda item: item[1]["busy"])
    return name, c["busy"]


def table(run: Run, label: str) -> str:
    """What `psar links` prints for one run."""
    found = busy(run)
    if found is None:
        return f"{label}: no links' timeline (a run on an emulated network, --net, writes {LINKS_FILE})"
    tenths = found["fine"]  # else a tenth falls between two readings
    lines = [f"{label}: {found['steps']} steps, median {1e3 * found['step_s']:.1f} ms, links read every "
             f"{1e3 * found['interval_s']:.0f} ms; each link's share of a step at its rate (median over the steps)"
             + (", and each tenth of a step (mean)" if tenths else "; a tenth of a step is shorter than that"),
             f"{'links':<22}{'busy':>6}  " + (" ".join(f"{f'{10 * k}%':>4}" for k in range(TENTHS)) if tenths else "")]
    for name, c in found["classes"].items():
        count = f"{name} ({c['links']})"
        lines.append(f"{count:<22}{100 * c['busy']:>5.0f}%  "
                     + (" ".join(f"{100 * x:>4.0f}" for x in c["tenths"]) if tenths else ""))
    idlest = min(found["links"], key=found["links"].get)
    lines.append(f"least busy: {idlest} {100 * found['links'][idlest]:.0f}%; busiest: "
                 f"{max(found['links'], key=found['links'].get)} {100 * max(found['links'].values()):.0f}%")
    return "\n".join(lines)
